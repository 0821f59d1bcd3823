"""End to end at an equal GPU KV budget: baseline vs the HiSparse modes (issue 5). cli: the
command; plan: sizes and the run matrix; run_args: the children's arguments; children: the
processes of a run; runs: the run loop; load: the streams; sampler: what is sampled beside them;
stats, report: analysis and tables; roofline, row_formats: analyses of finished runs (each also
`python -m bench.e2e.<name> E2E.json`)."""
