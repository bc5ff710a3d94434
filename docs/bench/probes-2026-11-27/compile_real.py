"""Real decoder: post-attention part of each layer through torch.compile; ar speed on a few prompts."""
import sys, time, statistics, torch
MODE = sys.argv[1]
torch.set_num_threads(2)
import torch._dynamo, torch._inductor.config as icfg
icfg.freezing = False; icfg.cpp.weight_prepack = False
torch._dynamo.config.cache_size_limit = 256
torch._dynamo.config.accumulated_cache_size_limit = 1024
import speculum.runners.packed as P
@torch.library.custom_op("spx::plinear", mutates_args=())
def plinear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")
@plinear.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])
def packed_linear(weight, bias=None):
    if bias is not None or weight.dtype != torch.bfloat16: return None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    out = weight.shape[0]
    def f(x):
        return plinear(x, packed)
    return f
P.packed_linear = packed_linear
from speculum.runners import decoder as D
D.packed_linear = packed_linear
from speculum.runners.invariance import NO_FLOORS

def post(self, layer, h, a):
    if layer.pre_mlp_norm is not None:
        h = h + layer.post_attn_norm(a); x = layer.pre_mlp_norm(h)
    else:
        h = h + a; x = layer.post_attn_norm(h)
    gate, up = layer.gate_up(x, 1).chunk(2, dim=-1)
    m = layer.down(self.act(gate) * up, 1)
    return h + (layer.post_mlp_norm(m) if layer.post_mlp_norm is not None else m)

def pre(self, layer, h, cos, sin):
    s = self.shape; n = h.shape[0]
    x = layer.input_norm(h)
    qkv = layer.qkv(x, 1).view(n, s.heads + 2 * s.kv_heads, s.head_dim)
    return self._qkv_fused(layer, qkv, cos, sin)

cpost = torch.compile(post, dynamic=True) if MODE != "eager" else post
cpre = torch.compile(pre, dynamic=True) if MODE == "both" else pre

def layer_forward(self, i, layer, h, rope, attend, floors=NO_FLOORS):
    cos, sin = rope["sliding_attention" if layer.sliding else "full_attention"]
    q, k, v = cpre(self, layer, h, cos, sin)
    a = layer.o(attend(i, layer, q, k, v), floors.o)
    return cpost(self, layer, h, a)
D.NativeDecoder.layer_forward = layer_forward

import speculum
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.bench.data import load_prompts
model, tok = speculum.load("default", dtype="bfloat16")
m = build_method("ar", model, tok)
assert m.engine.runner.decoder.fused
qs = load_prompts("../shared/data/spec_bench/question_dev.jsonl", 1)
t = time.perf_counter(); m.run(encode_prompt(tok, qs[0].text, None), 8); print("warm/compile s", time.perf_counter() - t)
outs = []
tot_t = tot_n = 0
for q in qs:
    r = m.run(encode_prompt(tok, q.text, None), 64)
    tot_t += r.time_s - r.prefill_s; tot_n += r.new_tokens; outs.append(r.tokens)
print(MODE, f"decode {tot_n/tot_t:.1f} tok/s")
import pickle; pickle.dump(outs, open(f"/work/exp/outs_{MODE}.pkl", "wb"))
