"""The quality protocol: does pre-training pay, and most when labels are few? Its versions are
data (``protocols/v<N>.json``); ``python -m benchmarks.quality`` runs them."""
