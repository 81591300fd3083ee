"""The instances stage: masked-LM + next-sentence instances (``bertpipe instances``).

``pairs`` holds the paper's algorithm (segment pairs, truncation, document pools), ``masking``
chooses and corrupts the masked-LM positions, ``batch`` assembles and masks instances many at a
time and writes Parquet, ``stats`` sums the statistics
a manifest records, ``sharding`` holds out the eval split by document and lays instances out
in balanced shards.
beam_jobs/create_instances.py runs them in parallel.
"""
