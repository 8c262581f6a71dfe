#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool): install what its image lacks from the wheels
# carried in .whl/, then run the CUDA tests and the GPU benchmarks, everything logged under $OUT.
#   bash bench/gpu_run.sh [tests] [step] [ablation] [ablation1] [floor] [hetero] [sidp] [int4] [serve]
#   (default: tests ablation floor hetero; `tests` adds the SiDP replicas on the GPU)
#   BENCH_S: the benchmarks' seconds in all (they run one after another, beside the tests; hetero
#   waits for the tests); TEST_FILES: other test files; INT4_ARGS: e.g. --skip-linears
# The wheels (16 MB; .whl/ is ignored, listed in .git/info/exclude), made here before the call:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
#     gguf==0.19.0 llguidance==1.9.1 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
#     typing-inspection==0.4.5 annotated-types uvicorn==0.54.0 paramiko==5.1.0 bcrypt==5.0.0 cryptography==50.0.2 \
#     pynacl==1.6.2 cffi==2.1.1 pycparser==3.12 invoke==3.0.3 typing_extensions==4.16.0 \
#     openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
# and the device tool's run with carry [".whl"] and `bash bench/gpu_run.sh ...` (NVIDIA H200, 2026-11-26).
# `serve` (gLLM Fig. 10 on the GPU) also needs the requests and SmolLM2's tokenizer, drawn here (3.6 MB;
# .gpuserve/ is ignored too) and carried with the wheels, carry [".whl", ".gpuserve"]:
#   python bench/serve.py --save-workload .gpuserve --num-prompts 256 --max-model-len 2048 --max-output-len 512
# Benchmarks run in the order named; each one's time counts against BENCH_S.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; touch /tmp/gpu_run.start
# the image's own Python (root): the carried wheels and hpipe itself (editable: planner/, profiler/
# and launcher/ map to hpipe.*) go into its environment
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl > "$OUT/install.log" 2>&1 \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 \
  || { tail -5 "$OUT/install.log"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr -cd 'A-Za-z0-9_.-')
echo "device: $DEV"; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
what=${*:-tests ablation floor hetero}
BUDGET=${BENCH_S:-370}
[[ " $what " == *" tests "* ]] && touch /tmp/gpu_run.testing
timeout -k 5 "$BUDGET" bash -c '
  OUT="'"$OUT"'"
  for w in '"$what"'; do case $w in
    ablation) python3 bench/decode.py --setups gpu --repeats 1 --name "'"$DEV"'" > "$OUT/$w.log" 2>&1 ;;
    floor) python3 bench/decode.py --setups gpu-floor --repeats ${FLOOR_REPEATS:-2} --name "'"$DEV"'-floor" > "$OUT/$w.log" 2>&1 ;;
    ablation1) python3 bench/decode.py --setups gpu --gpu-stages 1 --repeats 1 --name "'"$DEV"'-1stage" > "$OUT/$w.log" 2>&1 ;;
    step) python3 bench/gpu_step.py > "$OUT/$w.log" 2>&1 ;;
    sidp) python3 bench/sidp_gpu.py --requests 12 --max-new-tokens 32 --hidden 1024 --layers 8 --name "'"$DEV"'" > "$OUT/$w.log" 2>&1 ;;
    serve) python3 bench/serve.py --setups device --device cuda:0 --stages 2 --workload .gpuserve \
        --num-prompts ${SERVE_PROMPTS:-128} --max-model-len 2048 --max-output-len 256 --max-batch 64 \
        --rates ${SERVE_RATES:-4,16,64} --name "'"$DEV"'" > "$OUT/$w.log" 2>&1 ;;
    int4) python3 bench/gpu_int4.py ${INT4_ARGS:-} --log-dir /tmp/int4-logs > "$OUT/$w.log" 2>&1 ;;
    hetero) while [ -e /tmp/gpu_run.testing ]; do sleep 2; done   # its CPU stage times need the cores the tests take
      python3 bench/hetero.py --devices cuda:0,cpu --hidden 1024 --layers 8 --tokens 512 --slices 4 \
        --new-tokens 32 --repeats 1 --name "'"$DEV"'" > "$OUT/$w.log" 2>&1 ;;
  esac; done' &
if [[ " $what " == *" tests "* ]]; then
  HPIPE_TEST_DEVICES=cuda timeout 280 python3 -m pytest -q -p no:cacheprovider -n 4 --dist loadfile --timeout 200 \
    ${TEST_FILES:-tests/test_cuda.py tests/test_exactness.py tests/test_quant.py tests/test_sidp_runtime.py} -k "cuda or gpu" --junitxml /tmp/cuda-tests.xml \
    > "$OUT/cuda-tests.log" 2>&1
  echo "tests: rc $?"; rm -f /tmp/gpu_run.testing; tail -n 25 "$OUT/cuda-tests.log"
fi
wait
# one archive (the device tool brings back 8 files): the results written here, the stage logs, the junit XML
tar czf "$OUT/results.tgz" $(find bench/results -type f -newer /tmp/gpu_run.start) /tmp/int4-logs /tmp/cuda-tests.xml 2>/dev/null
for w in $what; do [ -f "$OUT/$w.log" ] && { echo "== $w"; tail -n 22 "$OUT/$w.log"; }; done
