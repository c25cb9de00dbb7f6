"""Prepared device runs (`scripts/gpu_check.sh`, `python -m artifact.gpu_check`): on a bare GPU
machine with no internet, install the carried wheels, build the C extension and run one plan —
`serve` (the served comparison at steady state), `mechanism` (libsmctrl, the doctor with MPS off
and on, the SM probe, the GPU-marked tests) or `engine` (the engine micro-benchmark, the profile),
or the stalest of them — within 8 minutes, and write one report (`report.md` + `results.json` +
`logs.tgz`) and the record of which plan ran when (`plans.json`).

Modules: `plan` (the plans, their steps and budgets), `record` (which plan last ran when), `wheels`
(the carried wheels), `machine` (what the numbers are labelled with; MPS; GPU memory), `procs`
(children with deadlines), `steps`, `serve` (the served comparison), `serve_budget` (what fits its
time), `steady` (a steady-state point's arithmetic), `replay`, `report`, `cli` (the orchestration)."""
