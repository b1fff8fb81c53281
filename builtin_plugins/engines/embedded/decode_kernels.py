"""Triton kernels of the embedded engine's decode step on CUDA: slot attention and plain sampling.

A decode step of a small model at a large batch is a chain of small kernels; two parts of it
took most of its time in a profile of the 0.5B shape at 256 rows (one H100, docs/benchmarks.md):

* **attention** (:func:`decode_attention`): torch's ``scaled_dot_product_attention`` over the
  first ``width`` cache columns needs the new key and value scattered into the cache first, a
  boolean mask turned into an additive one, and reads every row up to ``width``. One program
  per (row, key/value head) here writes the row's new key and value into its slot, then attends
  the query heads that share that key/value head (grouped-query attention, as transformers'
  ``repeat_kv`` pairs them) over the row's own columns ``0 .. pos`` only, with the online
  softmax of flash attention (Dao et al., 2022, "FlashAttention", alg. 1) in float32, the
  probabilities rounded to the cache's dtype for the product with the values as flash kernels do.
* **sampling** (:func:`sample_plain`): the draw of :func:`~.sampling.sample_batch` for rows with
  no top-k, top-p or banned tokens, in two kernels that read the logits once in their own dtype
  (no float32 copy of ``[rows, vocabulary]``): per block of :data:`BLOCK` tokens its maximum,
  its sum of ``exp(x / T - max)`` and its first argmax; then per row the log-normaliser, the
  greedy token, the block where the row's uniform number falls (its cumulative mass) and the
  token inside that block. Same two-level inverse CDF, same uniform numbers
  (:func:`~.sampling.uniform_from_counter`), same reported log-prob
  ``log_softmax(logits / T)[token]``; only float summation order differs from the torch code.

Both run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests
compare them with the torch code they replace.
"""

from __future__ import annotations

__all__ = ["BLOCK", "attention_fits", "decode_attention", "sample_plain", "triton_available"]

BLOCK = 1024  # tokens per block of the two-level inverse CDF (as sampling.inverse_cdf's default)

try:  # Triton ships with CUDA builds of torch (and the dev extra on Linux)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without triton
    triton = None


def triton_available() -> bool:
    """True when Triton imports (the kernels below exist)."""
    return triton is not None


def attention_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """True when :func:`decode_attention` handles this attention shape: a power-of-two head size of 16 to 256
    and query heads a multiple of key/value heads."""
    return (triton is not None and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
            and heads % kv_heads == 0)


if triton is not None:
    @triton.jit
    def _slot_decode_attention(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, scale,
                               stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh,
                               stride_cb, stride_ch, stride_cn, stride_ob, stride_oh,
                               GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                               D: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)  # (offsets into a large cache pass 2**31)
        h = tl.program_id(1).to(tl.int64)
        pos = tl.load(pos_ptr + b)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        in_group = g < GROUP
        q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=in_group[:, None], other=0.0)
        k_new = tl.load(kn_ptr + b * stride_knb + h * stride_knh + d)
        v_new = tl.load(vn_ptr + b * stride_vnb + h * stride_vnh + d)
        base = b * stride_cb + h * stride_ch
        tl.store(kc_ptr + base + pos * stride_cn + d, k_new)
        tl.store(vc_ptr + base + pos * stride_cn + d, v_new)
        # the new token first (never masked), so the running maximum starts finite
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        total = tl.full((BLOCK_G,), 1.0, tl.float32)
        acc = tl.zeros((BLOCK_G, D), tl.float32) + v_new.to(tl.float32)[None, :]
        for start in range(0, pos, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            earlier = n < pos
            k = tl.load(kc_ptr + base + n[:, None] * stride_cn + d[None, :], mask=earlier[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(earlier[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(vc_ptr + base + n[:, None] * stride_cn + d[None, :], mask=earlier[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            total = total * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / total[:, None]
        tl.store(out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])

    @triton.jit
    def _block_stats(x_ptr, temp_ptr, max_ptr, sum_ptr, arg_ptr, vocab, stride_x, blocks,
                     BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
        inside = cols < vocab
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
        x = x / tl.load(temp_ptr + row)
        top = tl.max(x, axis=0)
        first = tl.argmax(x, axis=0)
        mass = tl.sum(tl.where(x > float("-inf"), tl.exp(x - top), 0.0), axis=0)  # (a block of -inf: 0, not NaN)
        tl.store(max_ptr + row * blocks + blk, top)
        tl.store(sum_ptr + row * blocks + blk, mass)
        tl.store(arg_ptr + row * blocks + blk, blk * BLOCK_V + first)

    @triton.jit
    def _draw(x_ptr, temp_ptr, greedy_ptr, u_ptr, max_ptr, sum_ptr, arg_ptr, tok_ptr, lp_ptr, vocab, stride_x,
              blocks, BLOCK_V: tl.constexpr, BLOCKS_P2: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCKS_P2)
        in_blocks = j < blocks
        tops = tl.load(max_ptr + row * blocks + j, mask=in_blocks, other=float("-inf"))
        sums = tl.load(sum_ptr + row * blocks + j, mask=in_blocks, other=0.0)
        top = tl.max(tops, axis=0)
        masses = tl.where(tops > float("-inf"), sums * tl.exp(tops - top), 0.0)  # per block: sum of exp(x / T - top)
        total = tl.sum(masses, axis=0)
        log_norm = top + tl.log(total)
        # greedy: the first block holding the row's maximum, and that block's first argmax
        best_block = tl.min(tl.where(tops == top, j, BLOCKS_P2), axis=0)
        best = tl.load(arg_ptr + row * blocks + best_block)
        # inverse CDF over probabilities exp(x / T - log_norm): the block, then the token inside it
        probs = masses / total
        cdf = tl.cumsum(probs, axis=0)
        target = tl.load(u_ptr + row) * tl.sum(probs, axis=0)
        chosen = tl.minimum(tl.sum(tl.where(in_blocks & (cdf <= target), 1, 0), axis=0), blocks - 1)
        before = tl.sum(tl.where(j < chosen, probs, 0.0), axis=0)
        cols = chosen * BLOCK_V + tl.arange(0, BLOCK_V)
        inside = cols < vocab
        temp = tl.load(temp_ptr + row)
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32) / temp
        p = tl.where(x > float("-inf"), tl.exp(x - log_norm), 0.0)
        inner = tl.cumsum(p, axis=0) + before
        found = tl.sum(tl.where(inner <= target, 1, 0), axis=0)
        # rounding can leave the target past the block's last entry: its last token of non-zero mass
        last = tl.maximum(tl.max(tl.where(p > 0, tl.arange(0, BLOCK_V), -1), axis=0), 0)
        offset = tl.where(found < BLOCK_V, found, last)
        drawn = tl.minimum(chosen * BLOCK_V + offset, vocab - 1)
        token = tl.where(tl.load(greedy_ptr + row) != 0, best, drawn)
        logit = tl.load(x_ptr + row * stride_x + token).to(tl.float32) / temp
        tl.store(tok_ptr + row, token.to(tl.int64))
        tl.store(lp_ptr + row, logit - log_norm)


def decode_attention(query, key, value, k_cache, v_cache, positions, scale: float, *, block_n: int | None = None,
                     num_warps: int = 2, num_stages: int = 3):
    """Attention of one new token per row over its slot, writing the token's key and value into the slot.

    Row ``b`` is slot ``b``: its key and value go to column ``positions[b]`` of ``k_cache[b]`` and
    ``v_cache[b]``, and its query attends columns ``0 .. positions[b]`` (the new token included).

    :param query: ``[B, H, 1, D]``; :param key: and :param value: ``[B, H_kv, 1, D]`` (rotary applied),
        the cache's dtype, last dimension contiguous.
    :param k_cache: and :param v_cache: ``[S >= B, H_kv, L + 1, D]``, last dimension contiguous.
    :param positions: int64 ``[B]`` on the device, each in ``0 .. L``.
    :param scale: the softmax scale (``D ** -0.5`` unless the model sets another).
    :param block_n: cache columns per loop iteration (default 64, 32 above a head size of 128);
        ``num_warps`` and ``num_stages`` are Triton's launch options. The defaults were the fastest of
        27 choices on an H100 at 64 rows of 2,048-4,096 columns (``benchmarks/bench_gpu.py`` part
        ``kernels``: 56 us against 83 us for 4 warps and 2 stages).
    :returns: ``[B, 1, H, D]`` in the query's dtype (the layout transformers' attention functions return).
    """
    import torch

    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    out = torch.empty(batch, 1, heads, dim, dtype=query.dtype, device=query.device)
    q, k, v = query[:, :, 0], key[:, :, 0], value[:, :, 0]
    block_n = block_n or (64 if dim <= 128 else 32)
    _slot_decode_attention[(batch, kv_heads)](
        q, k, v, k_cache, v_cache, positions, out, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(2),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, D=dim,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # float32 exact; no effect on 16-bit inputs
        num_warps=num_warps, num_stages=num_stages)
    return out


def sample_plain(logits, temperature, greedy, seeds, counters):
    """:func:`~.sampling.sample_batch` without top-k, top-p or bans, by two Triton kernels.

    :param logits: ``[B, V]`` in any float dtype (bfloat16 from the model; read once, never copied),
        last dimension contiguous.
    :param temperature: float32 ``[B]`` (1 for greedy rows); :param greedy: bool ``[B]``.
    :param seeds: and :param counters: int64 ``[B]`` (:func:`~.sampling.uniform_from_counter`).
    :returns: ``(tokens int64 [B], log_probs float32 [B])``, ``log_prob = log_softmax(logits / T)[token]``.
    """
    import torch

    from .sampling import uniform_from_counter

    rows, vocab = logits.shape
    blocks = triton.cdiv(vocab, BLOCK)
    dev = logits.device
    tops = torch.empty(rows, blocks, dtype=torch.float32, device=dev)
    sums = torch.empty(rows, blocks, dtype=torch.float32, device=dev)
    args = torch.empty(rows, blocks, dtype=torch.int32, device=dev)
    _block_stats[(rows, blocks)](logits, temperature, tops, sums, args, vocab, logits.stride(0), blocks,
                                 BLOCK_V=BLOCK, num_warps=4)
    tokens = torch.empty(rows, dtype=torch.long, device=dev)
    log_probs = torch.empty(rows, dtype=torch.float32, device=dev)
    u = uniform_from_counter(seeds, counters)
    _draw[(rows,)](logits, temperature, greedy, u, tops, sums, args, tokens, log_probs, vocab, logits.stride(0),
                   blocks, BLOCK_V=BLOCK, BLOCKS_P2=max(16, triton.next_power_of_2(blocks)), num_warps=4)
    return tokens, log_probs
