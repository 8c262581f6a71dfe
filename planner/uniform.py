"""Plans without a profile: uniform cuts by unit count, or cuts and slices given by hand."""

from __future__ import annotations

from hpipe import __version__, formats, models, quant
from hpipe.errors import HpipeError


def uniform_cuts(n_units: int, n_stages: int) -> list[int]:
    """The n_stages - 1 interior cut positions that spread n_units as evenly as possible."""
    if not 1 <= n_stages <= n_units:
        raise HpipeError(f"cannot split {n_units} units into {n_stages} stages (1 to {n_units} stages fit)")
    return [round(i * n_units / n_stages) for i in range(1, n_stages)]


def make_plan(model_name: str, config, devices: list[tuple[str, str]], cuts: list[int] | None = None,
              slices: list[int] | None = None, num_slices: int | None = None, granularity: int = 16,
              dtype: str = "float32", weights: str = "none", kv_dtype: str = formats.KV_DTYPE) -> formats.Plan:
    """devices: (host, device) per stage, in pipeline order; weights: the format asked for (each
    stage records what it will run, `hpipe.quant.planned`)."""
    n_units = models.num_units(config)
    n_stages = len(devices)
    if cuts is None:
        cuts = uniform_cuts(n_units, n_stages)
    if len(cuts) != n_stages - 1:
        raise HpipeError(f"--cuts gives {len(cuts)} cut positions; {n_stages} stages need {n_stages - 1}")
    bounds = [0, *cuts, n_units]
    for a, b in zip(bounds, bounds[1:]):
        if not a < b:
            raise HpipeError(f"--cuts {','.join(map(str, cuts))}: cut positions must increase strictly within "
                             f"1..{n_units - 1} (the model has {n_units} units: 0 = embedding, "
                             f"{n_units - 1} = norm + head)")
    if slices is not None and any(s < 1 for s in slices):
        raise HpipeError(f"--slices {','.join(map(str, slices))}: slice lengths must be positive token counts")
    slicing = formats.Slicing(count=num_slices or max(1, 2 * n_stages), lengths=tuple(slices or ()),
                              granularity=granularity)
    stages = tuple(formats.StagePlan(host=h, device=d, units=(a, b), weights=quant.planned(weights, h, d))
                   for (h, d), a, b in zip(devices, bounds, bounds[1:]))
    plan = formats.Plan(model=model_identity(model_name, config), stages=stages, slicing=slicing, dtype=dtype, weights=weights,
                        kv_dtype=kv_dtype, created_by=f"hpipe {__version__} (uniform)")
    formats.validate_plan(plan)
    return plan


def model_identity(name: str, config) -> formats.ModelIdentity:
    """What a plan records of its model (checked against the model the launch loads)."""
    return formats.ModelIdentity(name=name, family=config.model_type, units=models.num_units(config),
                                 blocks=models.num_blocks(config), fingerprint=models.fingerprint(config))
