"""The model: BERT's forward pass (``bert``), checkpoint IO in the transformers layout
(``checkpoint``), and the export of a DeepSpeed run to that layout (``bertpipe export``)."""
