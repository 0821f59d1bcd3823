"""What the benchmark families share: child processes (bench.shared.child), kernel names
(bench.shared.kernel_names), timing, the copy-grid flags, the replayed top-k trace and the
result file (bench.shared.result_file)."""
