"""The pretrain stage: DeepSpeed pre-training on 1..N nodes (``bertpipe pretrain``).

``data`` reads instance shards with an exact-resume loader, ``loop`` runs one rank's phases,
``ds_config`` renders the DeepSpeed config from the typed config, ``launch`` renders the
``deepspeed`` command line, ``metrics`` keeps the run's ``metrics.jsonl``.
``python -m bert_core.pretrain`` is what each rank runs.
"""
