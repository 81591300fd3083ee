"""The vocab stage: word counts to a WordPiece vocab, and the tokenizer (``bertpipe vocab``).

``wordcount`` splits text into words as BERT's basic tokenizer does, ``training`` trains the
WordPiece vocab from counts with HF ``tokenizers``, ``tokenization`` is the tokenizer every later
stage uses (``load_tokenizer`` opens a vocab stage, a model folder or a ``vocab.txt``).
beam_jobs/build_vocab.py counts words in parallel.
"""
