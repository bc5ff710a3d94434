"""Adding a learned drafter is its file plus one registry entry: a toy one, defined here (head, config
and drafter: what its one file would hold), registered with one call, loads from a head file, runs
as a method with output equal to ``ar``'s, and becomes an ``auto`` arm."""

from dataclasses import asdict, dataclass

import torch
from conftest import tiny_llama
from torch import nn

from speculum.drafters import DRAFTERS, Drafter, register_learned
from speculum.heads import LEARNED, LearnedKind, head_for_target, save_head
from speculum.methods import build_method
from speculum.tree import DraftTree


@dataclass
class ToyConfig:
    hidden: int

    def to_dict(self) -> dict:
        return asdict(self)


class ToyHead(nn.Module):
    """Next-token features from the last token's embedding: ``[n, D]`` -> ``[n, D]``."""

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.hidden, config.hidden, bias=False)

    def freeze(self):
        return self.eval().requires_grad_(False)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.proj(embeds)


class ToyDrafter(Drafter):
    """A greedy chain of ``depth`` tokens, each from the head on the previous token's embedding."""

    name = "toy"

    def __init__(self, target, draft_head=None, depth: int = 3):
        self.head, self.tables, _ = head_for_target(target, "toy", draft_head)
        self.depth = depth

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        drafted, last = [], tokens[-1]
        for _ in range(min(budget, self.depth)):
            feats = self.head(self.tables.embeds(torch.tensor([last])))
            last = int(self.tables.token_ids(self.tables.logits(feats).argmax(-1))[0])
            drafted.append(last)
        return DraftTree.chain(drafted)


def test_a_toy_learned_drafter_is_one_registry_entry(tmp_path):
    model = tiny_llama()
    torch.manual_seed(0)
    head = ToyHead(ToyConfig(model.config.hidden_size))
    width = model.get_output_embeddings().weight.shape[0]
    register_learned("toy", LearnedKind(ToyConfig, ToyHead, ToyDrafter, "a toy head"))
    try:
        path = save_head(tmp_path / "toy.safetensors", "toy", head, None, {"vocab": width})
        prompt = [3, 17, 5, 9, 30, 2]
        want = build_method("ar", model, None).run(prompt, 24).tokens
        assert build_method("toy", model, None, draft_head=str(path)).run(prompt, 24).tokens == want
        auto = DRAFTERS["auto"].factory(target=model, draft_head=str(path))
        assert isinstance(auto.learned["toy"], ToyDrafter)
    finally:
        del LEARNED["toy"], DRAFTERS["toy"]
