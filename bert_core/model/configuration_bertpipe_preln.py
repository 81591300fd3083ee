"""The config of a pre-LN BERT exported by bertpipe, for transformers' remote code.

``bertpipe export`` (``bert_core/model/checkpoint.py``) copies this file and
``modeling_bertpipe_preln.py`` beside the weights of a pre-LN model, and points ``auto_map`` in
its ``config.json`` at them, so that

    transformers.AutoModel.from_pretrained(folder, trust_remote_code=True)

builds the pre-LN encoder. It imports transformers only: it runs where bertpipe is not installed.
"""

from transformers import BertConfig


class BertpipePreLNConfig(BertConfig):
    """``BertConfig``'s fields; the model type says the layers are pre-LN (``x + f(LN(x))``, one
    final LayerNorm), which transformers' own BERT is not."""

    model_type = "bertpipe-preln-bert"
