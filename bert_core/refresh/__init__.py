"""The refresh stage: keeping a model line fresh as new dumps appear (``bertpipe refresh``,
``bertpipe models``).

``registry`` holds every model version with its lineage, scores and gate decision, and the
aliases ``current`` and ``previous``; ``gate`` holds the refresh's plain steps (the continued
pre-training config, the evaluation suite's scores, the gate); ``importing`` registers a public
checkpoint as the start of a line. flows/refresh.py runs them between the stages.
"""
