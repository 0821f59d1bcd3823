"""Every kernel against its same-run comparison (`python -m bench.kernels`); the *_cases modules
are its cases. Also attention_sweep (launch configurations of sparse MLA decode), ncu_copy (the
miss copy alone, for Nsight Compute), copy_regs and sm90_report (the miss copy's registers as
compiled), coresidency (which step kernels leave room for copy CTAs), each
`python -m bench.kernels.<name>`."""
