"""The GPU check: one script, prepared on CPU, that measures what only a GPU can show in one short
slot (``python -m benchmarks.gpu.gpu_check``)."""
