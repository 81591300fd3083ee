"""Speed benchmarks: each ``bench_<name>.py`` times a stage of ours beside its reference and writes
``bench-results/<name>.json``; ``python -m benchmarks.run_all`` runs them all."""
