"""What the benchmark families share: child processes (bench.shared.child), kernel names
(bench.shared.kernel_names), timing, the copy-grid flags and the replayed top-k trace."""
