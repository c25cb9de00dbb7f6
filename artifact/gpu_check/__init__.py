"""One prepared device run (`scripts/gpu_check.sh`, `python -m artifact.gpu_check`): on a bare GPU
machine with no internet, install the carried wheels, build the C extension, run `bullet doctor`
with MPS off and on, the GPU-marked tests, the engine micro-benchmark and a served comparison, each
within its share of 8 minutes, and write one report (`report.md` + `results.json` + `logs.tgz`).

Modules: `plan` (the steps and their budgets), `wheels` (the carried wheels), `machine` (what the
numbers are labelled with; MPS; GPU memory), `procs` (children with deadlines), `steps`, `serve`
(the served comparison), `report`, `cli` (the orchestration)."""
