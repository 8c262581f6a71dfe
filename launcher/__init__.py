"""hpipe's launcher: prepares a job from a plan and prompts, starts the stage workers, collects
their reports into the results file. `launcher.local` runs workers as local processes."""
