import pytest

from bert_core.config import (
    ConfigError,
    ModelConfig,
    apply_set,
    config_hash,
    load_config,
    preset_names,
)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_validates(name):
    cfg = load_config(name)
    for phase in cfg.pretrain.phases:
        per_step = cfg.pretrain.world_size * phase.micro_batch_size
        assert phase.global_batch_size % per_step == 0
    assert cfg.model.hidden_size % cfg.model.num_attention_heads == 0


def test_presets_include_the_paper_settings():
    assert {"demo", "bert-base-128", "bert-base-512", "bert-large-128"} <= set(preset_names())
    base = load_config("bert-base-512")
    assert (base.model.num_hidden_layers, base.model.hidden_size, base.model.num_attention_heads) == (12, 768, 12)
    assert [p.max_seq_length for p in base.pretrain.phases] == [128, 512]
    assert base.instances.masked_lm_prob == 0.15 and base.pretrain.adam_epsilon == 1e-6
    large = load_config("bert-large-128")
    assert (large.model.num_hidden_layers, large.model.hidden_size) == (24, 1024)


def test_set_overrides_nested_fields_and_list_items():
    cfg = load_config("demo", sets=["instances.dupe_factor=3", "pretrain.phases.0.max_steps=7",
                                   "finetune.seeds=[4, 5]"])
    assert cfg.instances.dupe_factor == 3
    assert cfg.pretrain.phases[0].max_steps == 7
    assert cfg.finetune.seeds == [4, 5]


def test_config_file_overrides_preset(tmp_path):
    f = tmp_path / "my.yaml"
    f.write_text("vocab:\n  vocab_size: 1000\nmodel:\n  size: mini\n")
    cfg = load_config("demo", f)
    assert cfg.vocab.vocab_size == 1000 and cfg.model.hidden_size == 256
    assert cfg.instances.dupe_factor == load_config("demo").instances.dupe_factor


@pytest.mark.parametrize(
    "assignment, words",
    [
        ("pretrain.phases.0.global_batch_size=33", ["global_batch_size=33", "multiple of 64"]),
        ("instances.lengths.0.max_predictions_per_seq=500", ["max_predictions_per_seq=500", "max_seq_length - 3"]),
        ("model.num_attention_heads=3", ["num_attention_heads=3", "divisible"]),
        ("pretrain.phases.0.max_seq_length=256", ["has no instances", "instances.lengths"]),
        ("instances.masked_lm_prob=1.5", ["instances.masked_lm_prob"]),
        ("vocab.vocab_szie=10", ["vocab.vocab_szie: unknown key; did you mean vocab.vocab_size"]),
        ("vocab.size=10", ["vocab.size: unknown key; did you mean vocab.vocab_size"]),
        ("pretrain.vocab_size=10", ["pretrain.vocab_size: unknown key here; did you mean vocab.vocab_size"]),
        ("pretrain.phases.0.lr=1", ["pretrain.phases.0.lr: unknown key; did you mean pretrain.phases.0.learning_rate"]),
        ("pretrain.precision=fp16", ["fp16 needs accelerator=gpu"]),
        ("finetune.by_checkpoint={minilm: {learning_rates: [-1]}}", ["by_checkpoint.minilm", "above 0"]),
        ("finetune.by_checkpoint={minilm: {lr: 1}}", ["by_checkpoint.minilm.lr: unknown key; did you mean "
                                                     "finetune.by_checkpoint.minilm.learning_rates"]),
        ("finetune.by_checkpoint={minilm: {tasks: [ner]}}", ["by_checkpoint.minilm sets tasks", "every checkpoint"]),
    ],
)
def test_invalid_configs_name_the_field_and_the_fix(assignment, words):
    with pytest.raises(ConfigError) as err:
        load_config("demo", sets=[assignment])
    for w in words:
        assert w in str(err.value)


def test_every_config_error_is_reported_at_once(tmp_path):
    """Unknown keys, bad values and a section's own checks, from a file and --set, in one message."""
    f = tmp_path / "two.yaml"
    f.write_text("vocab:\n  size: 3\ninstances:\n  masked_lm_prob: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config("demo", f, sets=["pretrain.phases.0.lr=1", "pretrain.phases.0.global_batch_size=33",
                                     "pretrain.precision=fp16"])
    message = str(err.value)
    for words in ("vocab.size: unknown key; did you mean vocab.vocab_size?", "instances.masked_lm_prob",
                  "pretrain.phases.0.lr: unknown key", "global_batch_size=33", "fp16 needs accelerator=gpu"):
        assert words in message
    assert "\n" not in message


def test_a_checkpoint_takes_its_by_checkpoint_settings_over_the_rest():
    ft = load_config("demo", sets=["finetune.max_train_examples=64", "finetune.by_checkpoint="
                                   "{minilm: {learning_rates: [5.0e-5], epochs: [2]}}"]).finetune
    minilm, tiny = ft.for_checkpoint("minilm"), ft.for_checkpoint("pretrained")
    assert (minilm.learning_rates, minilm.epochs, minilm.max_train_examples) == ([5e-5], [2.0], 64)
    assert (tiny.learning_rates, tiny.epochs) == (ft.learning_rates, ft.epochs)
    assert minilm.by_checkpoint == {}


def test_bad_inputs_to_the_loader():
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("demo", "/no/such/file.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        apply_set({}, "novalue")


def test_config_hash_is_stable_and_sensitive():
    a, b = load_config("demo"), load_config("demo")
    assert config_hash(a.instances, {"x": 1}) == config_hash(b.instances, {"x": 1})
    c = load_config("demo", sets=["instances.seed=1"])
    assert config_hash(a.instances) != config_hash(c.instances)


def test_gpu_presets_pad_the_vocab_and_use_loader_workers():
    for name in preset_names():
        cfg = load_config(name)
        rows = cfg.model.for_vocab(cfg.vocab.vocab_size).vocab_size
        if cfg.pretrain.accelerator == "gpu":
            assert rows == 30528 and rows % 64 == 0 and cfg.pretrain.loader_workers == 4, name
        else:
            assert rows == cfg.vocab.vocab_size, name  # the CPU demo keeps its exact vocab
    padded = ModelConfig(size="tiny", pad_vocab_to_multiple=64)
    assert padded.for_vocab(128).vocab_size == 128 and padded.for_vocab(129).vocab_size == 192
    assert ModelConfig(size="tiny", vocab_size=200, pad_vocab_to_multiple=8).for_vocab(99).vocab_size == 200


def test_a_setting_added_later_enters_a_version_only_when_set():
    cfg = load_config("demo")
    added = {"pad_vocab_to_multiple": 64, "compile": True, "compile_mode": "max-autotune", "token_buckets": 8,
             "mlm_loss_chunk": 1024, "deepspeed": {"activation_checkpointing": {"number_checkpoints": 2}},
             "compile_backend": "eager",
             "accelerator": "gpu", "precision": "bf16",
             "pooling": "mean", "reinit_layers": 1, "layerwise_lr_decay": 0.8,
             "poolings": ["cls", "mean"], "layerwise_lr_decays": [1.0, 0.8], "save_every_job": True,
             "submission": False}
    for part in (cfg.model, cfg.pretrain, cfg.finetune):
        own = {k: v for k, v in added.items() if k in type(part).model_fields
               and type(part).model_fields[k].json_schema_extra}
        before = part.model_dump(mode="json", exclude=set(own))  # the config as stored before them
        assert own and config_hash(part) == config_hash(before), own
        for name, value in own.items():
            assert config_hash(part.model_copy(update={name: value})) != config_hash(part), name


def test_a_setting_may_name_the_storage_root():
    """``{storage_root}`` in any string setting becomes the storage root once, where the config is
    loaded: after every --set, and as `config show` prints it."""
    from typer.testing import CliRunner

    from flows.cli.main import app

    cfg = load_config("bert-base-128", sets=["storage_root=gs://bucket/bert/"])
    assert cfg.finetune.data_dir == "gs://bucket/bert/tasks"
    assert cfg.corpus.wikipedia == ["gs://bucket/bert/downloads/wikipedia/*/enwiki-*-pages-articles*.xml*.bz2"]
    mine = load_config("demo", sets=["storage_root=/data/x", "finetune.data_dir='{storage_root}/glue'"])
    assert mine.finetune.data_dir == "/data/x/glue"
    assert load_config("demo").finetune.data_dir == "samples/tasks"
    shown = CliRunner().invoke(app, ["config", "show", "--preset", "bert-base-512", "--set", "storage_root=/srv/b"])
    assert shown.exit_code == 0 and "data_dir: /srv/b/tasks" in shown.output and "{storage_root}" not in shown.output
