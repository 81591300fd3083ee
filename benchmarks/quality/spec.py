"""The protocol's versions and recipes as data: ``protocols/v<N>.json`` (tasks, sizes, runs,
seeds, budgets, grid, candidates, corpora, choice rule, goals, arms and the quick mode's draws)
and ``protocols/recipes.json`` (every recipe, each once, by name). A version's ``grid`` is the
product's fine-tuning grid: ``FinetuneConfig`` grid fields (``learning_rates``, ``poolings``,
``layerwise_lr_decays``, ...) expanded by ``bert_core.finetune.grid.settings``.

    from benchmarks.quality.spec import RECIPES, protocol
    plan = protocol("v3")                 # the draws of version 3
    RECIPES["k2"].instance_sets()         # a recipe as product settings
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from bert_core.config import FinetuneConfig
from bert_core.finetune.grid import settings

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PROTOCOLS = HERE / "protocols"
PRETRAIN_SEED = 42  # the product's default; run k of an arm pre-trains (or initialises) with seed 42 + k
# A fine-tuning setting's values where it names none (``min_steps``: see ``finetune.py``)
SETTING_DEFAULTS = {"learning_rate": 1e-3, "epochs": 6.0, "min_steps": 100, "batch_size": 32, "max_seq_length": 64,
                    "pooling": "cls", "reinit_layers": 0, "layerwise_lr_decay": 1.0}
# A FinetuneConfig grid field -> the setting's field it fills, and the product Setting's attribute
GRID_FIELDS = {"learning_rates": ("learning_rate", "learning_rate"), "batch_sizes": ("batch_size", "batch_size"),
               "epochs": ("epochs", "num_train_epochs"), "poolings": ("pooling", "pooling"),
               "layerwise_lr_decays": ("layerwise_lr_decay", "layerwise_lr_decay")}


@dataclass(frozen=True)
class Recipe:
    """How a small BERT is pre-trained: product settings of the instances stage and of
    pre-training (model settings it does not name are the demo preset's), and for the in-process
    choice the share of pieces masked and the corpus."""

    about: str
    seq: int = 128
    next_sentence_prediction: bool = True
    masking: str = "static"
    whole_word_mask: bool = False
    model: dict = field(default_factory=lambda: {"size": "tiny"})
    global_batch: int = 32
    learning_rate: float = 1e-3
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01  # the product's default (pretrain.weight_decay)
    masked_lm_prob: float = 0.15
    corpus: str | None = None  # None: the quick mode's corpus (the sample tweets)

    @property
    def size(self) -> str:
        return self.model["size"]

    @property
    def batch(self) -> int:
        return self.global_batch

    def key(self) -> dict:
        """The recipe in a cache key: its fields, less those of :data:`LATER_FIELDS` at their
        defaults (a recipe that leaves them alone keeps the key it had without them) and the
        corpus (keyed by the instances' manifest)."""
        return {k: v for k, v in asdict(self).items()
                if k != "corpus" and not (k in LATER_FIELDS and v == LATER_FIELDS[k])}

    def instance_sets(self) -> list[str]:
        length = {"max_seq_length": self.seq, "max_predictions_per_seq": math.ceil(self.seq * 0.15)}
        return [f"instances.lengths=[{json.dumps(length)}]",
                f"instances.next_sentence_prediction={str(self.next_sentence_prediction).lower()}",
                f"instances.masking={self.masking}",
                f"instances.whole_word_mask={str(self.whole_word_mask).lower()}",
                f"pretrain.phases=[{json.dumps({'max_seq_length': self.seq})}]"]

    def pretrain_sets(self, steps: int, ranks: int, seed: int = PRETRAIN_SEED) -> list[str]:
        phase = {"max_seq_length": self.seq, "max_steps": steps, "global_batch_size": self.global_batch,
                 "micro_batch_size": self.global_batch // ranks, "learning_rate": self.learning_rate,
                 "warmup_steps": max(1, round(steps * self.warmup_fraction))}
        return [self.instance_sets()[0], f"pretrain.phases=[{json.dumps(phase)}]", f"pretrain.procs_per_node={ranks}",
                f"pretrain.checkpoint_every={max(1, steps // 10)}", f"pretrain.log_every={max(1, min(50, steps // 10))}",
                "pretrain.eval_every=0", f"pretrain.seed={seed}", f"pretrain.weight_decay={self.weight_decay}",
                *(f"model.{k}={v}" for k, v in self.model.items())]


# Recipe fields a cache key leaves out at these values (fields added after keys were first written)
LATER_FIELDS = {f.name: f.default for f in fields(Recipe) if f.name in
                ("weight_decay", "masked_lm_prob")}

_RECIPES = json.loads((PROTOCOLS / "recipes.json").read_text())
RECIPES: dict[str, Recipe] = {name: Recipe(**r) for name, r in _RECIPES["recipes"].items()}
CHOSEN: str = _RECIPES["chosen"]


def grid_settings(grid: dict) -> list[dict]:
    """A version's ``grid`` as its settings: one per point of the product's grid over the
    ``FinetuneConfig`` grid fields it names, in the product's order (the order that breaks ties on
    dev), each holding the fields the data names (a job's cache key holds them) and its other
    entries as they are (``min_steps``). A grid field it does not name has one value, the default."""
    named = {k: v for k, v in grid.items() if k in GRID_FIELDS}
    one = {k: [SETTING_DEFAULTS[field]] for k, (field, _) in GRID_FIELDS.items()}
    fixed = {k: v for k, v in grid.items() if k not in GRID_FIELDS}
    return [{GRID_FIELDS[k][0]: getattr(point, GRID_FIELDS[k][1]) for k in named} | fixed
            for point in settings(FinetuneConfig(**(one | named)))]


def versions() -> list[str]:
    return sorted(p.stem for p in PROTOCOLS.glob("v*.json"))


def protocol(version: str, quick: bool = False) -> dict:
    """Version ``version``'s data; with ``quick``, its tiny draws in place of the real ones (the
    bookkeeping on tiny data). ``sizes`` hold None for the whole training pool."""
    data = json.loads((PROTOCOLS / f"{version}.json").read_text())
    plan = data | data["quick"] | {"quick": True} if quick else data | {"quick": False}
    return plan | {"grid": grid_settings(plan["grid"])}


def candidates(version: str) -> dict[str, Recipe]:
    """The version's candidate recipes, in its table order (the choice's tie-break)."""
    return {name: RECIPES[name] for name in protocol(version).get("candidates", [])}
