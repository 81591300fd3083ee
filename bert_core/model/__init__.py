"""The model: BERT's forward pass (``bert``), checkpoint IO in the transformers layout
(``checkpoint``), the export of a DeepSpeed run to that layout (``export``, ``bertpipe export``)
and the weight-decay groups every optimizer uses (``weight_decay``)."""
