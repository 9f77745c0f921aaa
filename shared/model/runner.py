"""The forward pass over the paged KV cache, for Llama-shaped decoder models.

Two entry points. `forward_packed` runs several sequences' pending tokens in one pass (a
prefill batch, or a resumed sequence's catch-up): the tokens are concatenated, so linear
layers see no padding, and attention runs per sequence. `forward_decode` runs exactly one
token for each of many sequences, with one batched attention call per layer over the
gathered blocks. Norms, MLPs and rotary tables are the transformers model's own modules, and
attention is computed with the same `scaled_dot_product_attention` calls transformers makes,
so float32 greedy tokens equal `model.generate`'s. On CPU in float32 the same arithmetic
runs through Tandem's kernels where they built (`cpu_kernels.py`: decode attention read in
place from the cache, fused norms and rotary) and the linear layers through oneDNN
with prepacked weights, or MKL or the kernels' few-row linear where it timed faster
(`cpu_gemm.py`), tested to the same greedy tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shared.kv.paged_cache import KVLayout, PagedKVCache
from shared.model import cpu_gemm, cpu_kernels
from shared.model.loader import LoadedModel


@dataclass
class PackedItem:
    """One sequence in a packed forward: `token_ids` start at absolute position `start`."""

    token_ids: list[int]
    start: int
    block_ids: list[int]


# Batches at least this wide run bf16 linear layers in float32 on CPUs without bf16 units.
UPCAST_MIN_ROWS = 3


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them torch's bf16 GEMM is emulated (~18 GFLOP/s measured
    on an AVX2-only EPYC at any batch size, against ~140 for float32), so batching helps
    nothing unless the matmul itself runs in float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True  # unknown platform: keep the plain path
    return "avx512_bf16" in flags or "amx_bf16" in flags


def kv_layout(model: LoadedModel, block_size: int) -> KVLayout:
    return KVLayout.of_config(model.config, block_size, model.dtype)


class ModelRunner:
    """Runs the model's layers against a PagedKVCache; returns last-position logits."""

    def __init__(self, model: LoadedModel, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.layout = cache.layout
        self.device = model.device
        hf: Any = model.hf_model
        self.embed = hf.model.embed_tokens
        self.layers = list(hf.model.layers)
        self.norm = hf.model.norm
        self.lm_head = hf.lm_head
        self.rotary = hf.model.rotary_emb
        cfg = model.config
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = self.layout.num_kv_heads
        self.head_dim = self.layout.head_dim
        self.n_rep = self.num_heads // self.num_kv_heads
        self.scaling = float(self.layers[0].self_attn.scaling)
        # CPU float32: paged attention and fused small ops in C++ (cpu_kernels.py); the
        # portable torch ops otherwise (and for models whose MLP is not SiLU-gated)
        silu = str(getattr(cfg, "hidden_act", "silu")) == "silu"
        self.kernels = cpu_kernels.load(self.device, model.dtype) if silu else None
        self.norms = [(ly.input_layernorm, ly.post_attention_layernorm) for ly in self.layers]
        # Qwen3 RMS-norms q and k per head before rotary (shared/model/architectures.py)
        self.qk_norms = [
            (a.q_norm, a.k_norm) if hasattr(a, "q_norm") else None
            for a in (ly.self_attn for ly in self.layers)
        ]
        # every linear layer's function: a oneDNN-packed weight (or MKL at few rows) on CPU fp32
        modules = [self.lm_head]
        for ly in self.layers:
            a, m = ly.self_attn, ly.mlp
            modules += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj]
            modules.append(m.down_proj)
        self.linear = cpu_gemm.linears(modules, self.device, model.dtype, kernels=self.kernels)
        self.upcast = (
            model.dtype == torch.bfloat16
            and self.device.type == "cpu"
            and not cpu_has_native_bf16()
        )

    def _linear(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """`module(x)`, computed in float32 for wide bf16 batches on CPUs without bf16 units."""
        if self.upcast and x.shape[0] >= UPCAST_MIN_ROWS:
            return _linear_fp32(module, x.float()).to(x.dtype)
        return self.linear[module](x)

    def _mlp(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        if self.upcast and x.shape[0] >= UPCAST_MIN_ROWS:
            xf = x.float()  # stay in float32 through the MLP: one conversion each way
            hidden = mlp.act_fn(_linear_fp32(mlp.gate_proj, xf)) * _linear_fp32(mlp.up_proj, xf)
            return _linear_fp32(mlp.down_proj, hidden).to(x.dtype)
        lin = self.linear  # the gated MLP transformers' LlamaMLP computes
        out: torch.Tensor = lin[mlp.down_proj](
            mlp.act_fn(lin[mlp.gate_proj](x)) * lin[mlp.up_proj](x)
        )
        return out

    def _slots(self, block_ids: list[int], start: int, count: int) -> list[int]:
        bs = self.layout.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, start + count)]

    def _qkv(
        self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[n, heads, d]`, k and v `[n, kv_heads, d]` for `n` tokens, rotary applied."""
        n, attn = x.shape[0], self.layers[layer_idx].self_attn
        q = self._linear(attn.q_proj, x).view(n, self.num_heads, self.head_dim)
        k = self._linear(attn.k_proj, x).view(n, self.num_kv_heads, self.head_dim)
        v = self._linear(attn.v_proj, x).view(n, self.num_kv_heads, self.head_dim)
        q, k = self._qk_norm(layer_idx, q, k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _qk_norm(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norms = self.qk_norms[layer_idx]
        if norms is None:
            return q, k
        return norms[0](q), norms[1](k)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(x, positions[None, :])
        return cos[0, :, None, :], sin[0, :, None, :]  # broadcast over heads

    def _layers(
        self,
        token_ids: list[int],
        positions: torch.Tensor,
        slots: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states of `token_ids` (at `positions`) after every decoder layer and the
        final norm. Each layer writes its K and V into the cache at `slots` first, then takes
        its attention output (a row per token) from `attend(layer_idx, q, k, v)`: the one step
        the two forwards do differently."""
        h: torch.Tensor = self.embed(torch.tensor(token_ids, device=self.device))
        cos, sin = self._rope(h, positions)
        if self.kernels is not None:
            return self._layers_fused(self.kernels, h, cos, sin, slots, attend)
        for layer_idx, layer in enumerate(self.layers):
            residual = h
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            q, k, v = self._qkv(layer_idx, x, cos, sin)
            self.cache.write(layer_idx, slots, k, v)
            o = attend(layer_idx, q, k, v)
            h = residual + self._linear(attn.o_proj, o.reshape(len(token_ids), -1))
            h = h + self._mlp(layer.mlp, layer.post_attention_layernorm(h))
        out: torch.Tensor = self.norm(h)
        return out

    def _layers_fused(
        self,
        ops: Any,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`_layers` with the CPU kernels: the same arithmetic in four calls per layer
        besides the GEMMs. The residual stream `h` is updated in place by add_rms_norm, which
        also returns the next norm's output (the next layer's input norm, or the final)."""
        n = h.shape[0]
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        norms, lin = self.norms, self.linear
        x: torch.Tensor = ops.rms_norm(h, norms[0][0].weight, norms[0][0].variance_epsilon)
        for layer_idx, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q = lin[attn.q_proj](x).view(n, self.num_heads, self.head_dim)
            k = lin[attn.k_proj](x).view(n, self.num_kv_heads, self.head_dim)
            v = lin[attn.v_proj](x).view(n, self.num_kv_heads, self.head_dim)
            q, k = self._qk_norm(layer_idx, q, k)
            ops.rope_store(q, k, v, cos, sin, self.cache.kv[layer_idx], slots)
            o = attend(layer_idx, q, k, v)
            post = norms[layer_idx][1]
            x = ops.add_rms_norm(
                h, lin[attn.o_proj](o.reshape(n, -1)), post.weight, post.variance_epsilon
            )
            # torch's silu, then the product in place: faster than a fused kernel whose exp
            # does not vectorise (docs/benchmarks-log.md, "oneDNN GEMMs")
            m = lin[mlp.down_proj](F.silu(lin[mlp.gate_proj](x)).mul_(lin[mlp.up_proj](x)))
            nxt = norms[layer_idx + 1][0] if layer_idx + 1 < len(norms) else self.norm
            x = ops.add_rms_norm(h, m, nxt.weight, nxt.variance_epsilon)
        return x

    def forward_packed(self, items: list[PackedItem]) -> torch.Tensor:
        """KV for every item's tokens into the cache; logits `[len(items), vocab]` of each last."""
        return self.forward_packed_hidden(items)[0]

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final hidden states `[n, hidden]` (`forward_packed_hidden`)."""
        return self._linear(self.lm_head, hidden).float()

    @torch.inference_mode()
    def forward_packed_hidden(self, items: list[PackedItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_packed`'s logits, and the final hidden state of every token, item after
        item `[sum of tokens, hidden]`: what prompt logprobs are computed from (`logits_of`)."""
        ids = [t for it in items for t in it.token_ids]
        positions = torch.tensor(
            [it.start + i for it in items for i in range(len(it.token_ids))], device=self.device
        )
        slots = torch.tensor(
            [s for it in items for s in self._slots(it.block_ids, it.start, len(it.token_ids))],
            device=self.device,
        )
        bounds: list[tuple[int, int]] = []
        offset = 0
        for it in items:
            bounds.append((offset, offset + len(it.token_ids)))
            offset += len(it.token_ids)

        def attend(
            layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            outs = [
                self._attend_prefix(layer_idx, it, q[a:b], k[a:b], v[a:b])
                for it, (a, b) in zip(items, bounds, strict=True)
            ]
            return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]

        h = self._layers(ids, positions, slots, attend)
        last = torch.tensor([b - 1 for _, b in bounds], device=self.device)
        return self.logits_of(h[last]), h

    def _attend_prefix(
        self, layer_idx: int, item: PackedItem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of one sequence's new tokens over its cached prefix and themselves."""
        n = q.shape[0]
        qh = q.transpose(0, 1)[None]  # [1, heads, n, d]
        if item.start == 0:
            out = F.scaled_dot_product_attention(
                qh,
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=n > 1,
                scale=self.scaling,
                enable_gqa=True,
            )
        else:
            total = item.start + n
            nblocks = self.layout.blocks_for_tokens(total)
            table = torch.tensor([item.block_ids[:nblocks]], device=self.device)
            kc, vc = self.cache.gather(layer_idx, table)
            kc, vc = kc[:, :, :total], vc[:, :, :total]
            qpos = torch.arange(item.start, total, device=self.device)
            mask = torch.arange(total, device=self.device)[None, :] <= qpos[:, None]
            out = F.scaled_dot_product_attention(
                qh, kc, vc, attn_mask=mask, scale=self.scaling, enable_gqa=True
            )
        return out[0].transpose(0, 1)  # [n, heads, d]

    @torch.inference_mode()
    def forward_decode(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """One new token per sequence (at `positions`); logits `[batch, vocab]`."""
        bs = self.layout.block_size
        pos = torch.tensor(positions, device=self.device)
        slots = torch.tensor(
            [
                table[p // bs] * bs + p % bs
                for table, p in zip(block_tables, positions, strict=True)
            ],
            device=self.device,
        )
        lengths = [p + 1 for p in positions]
        nblocks = -(-max(lengths) // bs)
        table = torch.tensor(
            [t[:nblocks] + [0] * (nblocks - len(t[:nblocks])) for t in block_tables],
            device=self.device,
        )
        if self.kernels is not None:
            attend = self._attend_paged(self.kernels.paged_decode_attention, table, lengths)
        else:
            attend = self._attend_gathered(table, lengths)
        h = self._layers(token_ids, pos, slots, attend)
        return self._linear(self.lm_head, h).float()

    def _attend_paged(
        self, kernel: Callable[..., torch.Tensor], table: torch.Tensor, lengths: list[int]
    ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """Decode attention read in place from the cache by the CPU kernel."""
        key_counts = torch.tensor(lengths, device=self.device)
        kv, batch = self.cache.kv, len(lengths)

        def attend(
            layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            qg = q.view(batch, self.num_kv_heads, self.n_rep, self.head_dim)
            return kernel(qg, kv[layer_idx], table, key_counts, self.scaling)

        return attend

    def _attend_gathered(
        self, table: torch.Tensor, lengths: list[int]
    ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """Decode attention by SDPA over a gathered copy of each sequence's blocks (any device)."""
        max_len, batch = max(lengths), len(lengths)
        mask: torch.Tensor | None = None
        if min(lengths) != max_len:
            keys = torch.arange(max_len, device=self.device)
            mask = (keys[None, :] < torch.tensor(lengths, device=self.device)[:, None])[
                :, None, None, :
            ]

        def attend(
            layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            kc, vc = self.cache.gather(layer_idx, table)  # this step's k and v written in
            kc, vc = kc[:, :, :max_len], vc[:, :, :max_len]
            # One query per sequence: fold the query heads of each KV group into the query
            # axis, so attention reads each KV head once instead of repeating it n_rep times.
            qg = q.view(batch, self.num_kv_heads, self.n_rep, self.head_dim)
            return F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=self.scaling)

        return attend


def _linear_fp32(module: Any, x: torch.Tensor) -> torch.Tensor:
    bias = None if module.bias is None else module.bias.float()
    return F.linear(x, module.weight.float(), bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
