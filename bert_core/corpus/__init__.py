"""The corpus stage: raw text in, documents of sentences out (``bertpipe corpus``).

Readers of Wikipedia XML dumps (``dumps``, ``bz2_blocks``, ``wikitext``) and of book folders
(``books``), the sentence splitter (``sentences``), exact and near-duplicate detection
(``dedup``), the documents contract with its filters and rejects (``documents``), and the
dump downloader (``download``). beam_jobs/clean_corpus.py runs them in parallel.
"""
