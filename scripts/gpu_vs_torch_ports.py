"""Plain torch.nn ports of Hilum's networks for scripts/gpu_vs_torch.py, each loading the seeded
weights Hilum's side wrote (crates/hilum-models/examples/torch_side_by_side/) under the names
Hilum reads. Imported only where PyTorch is.

- LungUnet: vk1996/Lung-Segmentation-TF's U-Net as crates/hilum-models/src/unet.rs runs it
  (Keras names and HWIO kernels mapped to torch's OIHW here; Keras `same` padding, which may be
  asymmetric; batch norm eps 1e-3; swish; squeeze-excitation; nearest upsampling; additive skips).
- SamImageEncoder: segment-anything's ImageEncoderViT (patch embedding, absolute and decomposed
  relative positions, windowed and global attention blocks, the neck), NHWC as the original.
- Qwen2 / Gemma3: decoders with a KV cache (RMSNorm, NeoX rotary embedding, grouped-query
  attention, SwiGLU / GELU-tanh FFN; Gemma 3's q/k norms, sandwich norms, scaled embeddings,
  sliding-window local layers with their own rotary base), greedy decoding.
"""
import math
import time

import torch
import torch.nn.functional as F
from torch import nn


def load_exact(module, state, what, assign=False):
    """Loads `state` (name -> tensor) into `module`, every name on both sides (`assign`: the
    tensors become the parameters, for a module built on the meta device)."""
    missing, unexpected = module.load_state_dict(state, strict=False, assign=assign)
    if missing or unexpected:
        raise SystemExit(f"{what}: weights do not fit the port: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return module


# ---------------------------------------------------------------- lung U-Net (Keras checkpoint)


def same_padding(size, k, stride):
    """Keras `same`: (before, after), the odd pixel after."""
    out = -(-size // stride)
    total = max((out - 1) * stride + k - size, 0)
    return total // 2, total - total // 2


class UnetBlock(nn.Module):
    """3x3 conv + BN + swish, [residual add + BN + swish], squeeze-excitation, 1x1 conv + swish."""

    def __init__(self, c_in, c, stride, residual, se_reduction):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(c_in, c, 3, stride)
        self.bn = nn.BatchNorm2d(c, eps=1e-3)
        self.residual_bn = nn.BatchNorm2d(c, eps=1e-3) if residual else None
        self.se_reduce = nn.Conv2d(c, c // se_reduction, 1)
        self.se_expand = nn.Conv2d(c // se_reduction, c, 1)
        self.project = nn.Conv2d(c, c, 1)

    def forward(self, x):
        h, w = x.shape[2:]
        pt, pb = same_padding(h, 3, self.stride)
        pl, pr = same_padding(w, 3, self.stride)
        y = F.silu(self.bn(self.conv(F.pad(x, (pl, pr, pt, pb)))))
        if self.residual_bn is not None:
            y = F.silu(self.residual_bn(x + y))
        gate = torch.sigmoid(self.se_expand(F.silu(self.se_reduce(y.mean((2, 3), keepdim=True)))))
        return F.silu(self.project(y * gate))


class LungUnet(nn.Module):
    """(b, s, s, 3) NHWC 0..255 -> (b, s, s, 1) lung probability, as Keras."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        enc, c_in = [], cfg["in_channels"]
        for i, c in enumerate(cfg["encoder_channels"]):
            enc.append(UnetBlock(c_in, c, 2 if i == 0 else 1, i > 0 and c == c_in, cfg["se_reduction"]))
            c_in = c
        dec = []
        for c in cfg["decoder_channels"]:
            dec.append(UnetBlock(c_in, c, 1, False, cfg["se_reduction"]))
            c_in = c
        self.encoder, self.decoder = nn.ModuleList(enc), nn.ModuleList(dec)
        self.head = nn.Conv2d(c_in, 1, 3, padding=1)
        self.head_bn = nn.BatchNorm2d(1, eps=1e-3)

    def forward(self, x):
        h = x.permute(0, 3, 1, 2)
        skips = []
        for i, block in enumerate(self.encoder):
            if i > 0:
                h = F.max_pool2d(h, 2)
            h = block(h)
            skips.append(h)
        skips.pop()  # the bottleneck is `h` itself
        for block in self.decoder:
            h = block(F.interpolate(h, scale_factor=2, mode="nearest"))
            if skips:
                h = h + skips.pop()
        return torch.sigmoid(self.head_bn(self.head(h))).permute(0, 2, 3, 1)

    def keras_names(self):
        """torch parameter name -> (Keras name, whether a kernel to turn from HWIO to OIHW)."""
        cfg, out, se = self.cfg, {}, 0

        def conv(prefix, keras):
            out[f"{prefix}.weight"] = (f"{keras}.kernel", True)
            out[f"{prefix}.bias"] = (f"{keras}.bias", False)

        def bn(prefix, keras):
            for t, k in [("weight", "gamma"), ("bias", "beta"), ("running_mean", "moving_mean"),
                         ("running_var", "moving_variance")]:
                out[f"{prefix}.{t}"] = (f"{keras}.{k}", False)

        def conv2d(n):
            return "conv2d" if n == 0 else f"conv2d_{n}"

        stages = [(f"encoder.{i}", f"conv{n}", f"bn{n}", f"bn{n}_a") for i, n in enumerate(cfg["encoder_ids"])]
        stages += [(f"decoder.{i}", f"resize_conv{n}", f"resize_bn{n}", None) for i, n in enumerate(cfg["decoder_ids"])]
        for (prefix, c, b, res), block in zip(stages, list(self.encoder) + list(self.decoder)):
            conv(f"{prefix}.conv", c)
            bn(f"{prefix}.bn", b)
            if block.residual_bn is not None:
                bn(f"{prefix}.residual_bn", res)
            for j, part in enumerate(["se_reduce", "se_expand", "project"]):
                conv(f"{prefix}.{part}", conv2d(se + j))
            se += 3
        conv("head", f"resize_conv{cfg['head_id']}")
        bn("head_bn", f"resize_bn{cfg['head_id']}")
        return out

    def load_keras(self, weights):
        state = {}
        for name, (keras, kernel) in self.keras_names().items():
            w = torch.from_numpy(weights[keras].copy())
            state[name] = w.permute(3, 2, 0, 1).contiguous() if kernel else w
        if len(state) != len(weights):
            raise SystemExit(f"lung U-Net: the port reads {len(state)} of the checkpoint's {len(weights)} tensors")
        return load_exact(self, state, "lung U-Net")


# ---------------------------------------------------------------- SAM ImageEncoderViT


def get_rel_pos(q_size, k_size, rel_pos):
    q = torch.arange(q_size)[:, None] * max(k_size / q_size, 1.0)
    k = torch.arange(k_size)[None, :] * max(q_size / k_size, 1.0)
    rel = (q - k) + (k_size - 1) * max(q_size / k_size, 1.0)
    return rel_pos[rel.long().to(rel_pos.device)]


class SamAttention(nn.Module):
    def __init__(self, dim, heads, input_size):
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * input_size - 1, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * input_size - 1, head_dim))

    def forward(self, x):
        b, h, w, _ = x.shape
        qkv = self.qkv(x).reshape(b, h * w, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * self.heads, h * w, -1).unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        # Decomposed relative positions (on the unscaled queries).
        rh, rw = get_rel_pos(h, h, self.rel_pos_h), get_rel_pos(w, w, self.rel_pos_w)
        r_q = q.reshape(b * self.heads, h, w, -1)
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, rh)
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, rw)
        attn = (attn.view(-1, h, w, h, w) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]).view(-1, h * w, h * w)
        x = (attn.softmax(dim=-1) @ v).view(b, self.heads, h, w, -1).permute(0, 2, 3, 1, 4).reshape(b, h, w, -1)
        return self.proj(x)


class SamMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.lin2(F.gelu(self.lin1(x)))


def window_partition(x, ws):
    b, h, w, c = x.shape
    ph, pw = (ws - h % ws) % ws, (ws - w % ws) % ws
    if ph or pw:
        x = F.pad(x, (0, 0, 0, pw, 0, ph))
    hp, wp = h + ph, w + pw
    x = x.view(b, hp // ws, ws, wp // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, c)
    return x, (hp, wp)


def window_unpartition(win, ws, pad, hw):
    (hp, wp), (h, w) = pad, hw
    b = win.shape[0] // (hp * wp // ws // ws)
    x = win.view(b, hp // ws, wp // ws, ws, ws, -1).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, -1)
    return x[:, :h, :w, :].contiguous()


class SamBlock(nn.Module):
    def __init__(self, dim, heads, window, input_size):
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = SamAttention(dim, heads, input_size if window == 0 else window)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = SamMlp(dim, 4 * dim)

    def forward(self, x):
        shortcut = x
        x = self.norm1(x)
        if self.window > 0:
            h, w = x.shape[1:3]
            x, pad = window_partition(x, self.window)
        x = self.attn(x)
        if self.window > 0:
            x = window_unpartition(x, self.window, pad, (h, w))
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class LayerNorm2d(nn.Module):
    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c)), eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class PatchEmbed(nn.Module):
    def __init__(self, p, dim):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, p, p)

    def forward(self, x):
        return self.proj(x).permute(0, 2, 3, 1)  # NHWC


class SamImageEncoder(nn.Module):
    """(b, 3, S, S) -> (b, prompt_embed_dim, S/p, S/p); parameter names as `image_encoder.*`."""

    def __init__(self, cfg):
        super().__init__()
        d, p, e = cfg["encoder_embed_dim"], cfg["patch_size"], cfg["prompt_embed_dim"]
        g = cfg["image_size"] // p
        self.patch_embed = PatchEmbed(p, d)
        self.pos_embed = nn.Parameter(torch.zeros(1, g, g, d))
        self.blocks = nn.ModuleList(
            SamBlock(d, cfg["encoder_num_heads"], 0 if i in cfg["global_attn_indexes"] else cfg["window_size"], g)
            for i in range(cfg["encoder_depth"]))
        self.neck = nn.Sequential(nn.Conv2d(d, e, 1, bias=False), LayerNorm2d(e),
                                  nn.Conv2d(e, e, 3, padding=1, bias=False), LayerNorm2d(e))

    def forward(self, x):
        x = self.patch_embed(x) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.neck(x.permute(0, 3, 1, 2))

    def load_checkpoint(self, weights):
        pre = "image_encoder."
        state = {k[len(pre):]: torch.from_numpy(v.copy()) for k, v in weights.items() if k.startswith(pre)}
        return load_exact(self, state, "SAM image encoder")


# ---------------------------------------------------------------- decoders (Hugging Face names)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (offset + weight), in f32 (Gemma's offset is 1)."""

    def __init__(self, d, eps, offset):
        super().__init__()
        self.weight, self.eps, self.offset = nn.Parameter(torch.ones(d)), eps, offset

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).to(x.dtype)


def rotary(head_dim, base, factor, positions, device):
    """cos, sin (positions, head_dim / 2), in f32 as Hilum computes them (on the CPU first, also
    while the module is built on the meta device)."""
    i = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    inv = 1.0 / torch.pow(torch.tensor(base, dtype=torch.float32, device="cpu"), 2.0 * i / head_dim) / factor
    ang = torch.arange(positions, dtype=torch.float32, device="cpu")[:, None] * inv[None, :]
    return ang.cos().to(device), ang.sin().to(device)


def rope_halves(x, cos, sin):
    """NeoX: element i turns with i + head_dim / 2. x (heads, t, hd), cos/sin (t, hd / 2)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, s, gemma):
        super().__init__()
        d, hd = s["hidden"], s["head_dim"]
        q, kv = s["heads"] * hd, s["kv_heads"] * hd
        self.q_proj = nn.Linear(d, q, bias=not gemma)
        self.k_proj = nn.Linear(d, kv, bias=not gemma)
        self.v_proj = nn.Linear(d, kv, bias=not gemma)
        self.o_proj = nn.Linear(q, d, bias=not gemma)
        if gemma:
            self.q_norm = RMSNorm(hd, s["eps"], 1.0)
            self.k_norm = RMSNorm(hd, s["eps"], 1.0)


class MLP(nn.Module):
    def __init__(self, d, f, act):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s, gemma):
        super().__init__()
        d, eps, off = s["hidden"], s["eps"], 1.0 if gemma else 0.0
        self.input_layernorm = RMSNorm(d, eps, off)
        self.self_attn = Attention(s, gemma)
        self.post_attention_layernorm = RMSNorm(d, eps, off)
        act = (lambda g: F.gelu(g, approximate="tanh")) if gemma else F.silu
        self.mlp = MLP(d, s["ffn"], act)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(d, eps, off)
            self.post_feedforward_layernorm = RMSNorm(d, eps, off)


class Decoder(nn.Module):
    """Qwen2 (`family` qwen2: biases on the projections, pre-norms, SwiGLU) or Gemma 3 (q/k norms,
    sandwich norms, GELU-tanh, embeddings times sqrt(hidden), local layers over a sliding
    window with their own rotary base); tied output layer; one sequence, a KV cache. Built under
    `torch.device("meta")`, `load_checkpoint` assigns the weights: no throw-away random
    initialisation of half a billion parameters."""

    def __init__(self, s, max_positions, device):
        super().__init__()
        self.s, self.gemma = s, s["family"] == "gemma3"
        self.embed_tokens = nn.Embedding(s["vocab"], s["hidden"])
        self.layers = nn.ModuleList(Layer(s, self.gemma) for _ in range(s["layers"]))
        self.norm = RMSNorm(s["hidden"], s["eps"], 1.0 if self.gemma else 0.0)
        hd = s["head_dim"]
        self.rope_global = rotary(hd, s["rope_base"], s["rope_scale"], max_positions, device)
        self.rope_local = rotary(hd, s["rope_local_base"], 1.0, max_positions, device) if self.gemma else None
        self.max_positions = max_positions
        self.reset()

    def load_checkpoint(self, weights):
        pre = "model." if not self.gemma else ""
        state = {k[len(pre):]: torch.from_numpy(v.copy()) for k, v in weights.items()}
        return load_exact(self, state, f"{self.s['family']} decoder", assign=True)

    def reset(self):
        self.cache, self.pos = None, 0

    def _cache(self, x):
        if self.cache is None:
            s = self.s
            shape = (len(self.layers), s["kv_heads"], self.max_positions, s["head_dim"])
            self.cache = (x.new_zeros(shape), x.new_zeros(shape))
        return self.cache

    def forward(self, tokens):
        """Logits of the last of `tokens` (a 1-d tensor) after the cached positions."""
        s, t, pos = self.s, tokens.shape[0], self.pos
        nh, nkv, hd = s["heads"], s["kv_heads"], s["head_dim"]
        group = nh // nkv
        x = self.embed_tokens(tokens)
        if self.gemma:
            x = x * torch.tensor(math.sqrt(s["hidden"]), dtype=x.dtype)
        kc, vc = self._cache(x)
        qp = torch.arange(pos, pos + t, device=x.device)[:, None]
        kp = torch.arange(pos + t, device=x.device)[None, :]
        hidden = kp > qp
        masks = {False: hidden, True: hidden | (qp - kp >= s["window"]) if self.gemma else hidden}
        for li, layer in enumerate(self.layers):
            local = self.gemma and s["local"][li]
            cos, sin = self.rope_local if local else self.rope_global
            cos, sin = cos[pos:pos + t], sin[pos:pos + t]
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(t, nh, hd)
            k = a.k_proj(h).view(t, nkv, hd)
            v = a.v_proj(h).view(t, nkv, hd)
            if self.gemma:
                q, k = a.q_norm(q), a.k_norm(k)
            q = rope_halves(q.transpose(0, 1), cos, sin)
            k = rope_halves(k.transpose(0, 1), cos, sin)
            kc[li, :, pos:pos + t] = k
            vc[li, :, pos:pos + t] = v.transpose(0, 1)
            keys, values = kc[li, :, :pos + t], vc[li, :, :pos + t]
            # Grouped-query attention: query heads g*group..(g+1)*group share kv head g.
            scores = (q.reshape(nkv, group * t, hd) @ keys.transpose(1, 2)) * s["attn_scale"]
            scores = scores.view(nkv, group, t, pos + t).masked_fill(masks[local], float("-inf"))
            y = (scores.softmax(-1).view(nkv, group * t, pos + t) @ values)
            y = a.o_proj(y.reshape(nh, t, hd).transpose(0, 1).reshape(t, nh * hd))
            if self.gemma:
                x = x + layer.post_attention_layernorm(y)
                x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            else:
                x = x + y
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.pos = pos + t
        return self.norm(x[-1]) @ self.embed_tokens.weight.t()


def generate(net, prompt, new, sync):
    """One greedy generation from an empty cache: the prompt's last logits (f32, host), the
    tokens, prefill ms and decode ms per token (each token read back, as Hilum's side does)."""
    with torch.inference_mode():
        net.reset()
        ids = torch.tensor(prompt, device=net.embed_tokens.weight.device)
        sync()
        t = time.perf_counter()
        logits = net(ids)
        nxt = int(logits.argmax())
        prefill = (time.perf_counter() - t) * 1e3
        tokens = [nxt]
        t = time.perf_counter()
        for _ in range(1, new):
            nxt = int(net(torch.tensor([nxt], device=ids.device)).argmax())
            tokens.append(nxt)
        per_token = (time.perf_counter() - t) * 1e3 / max(new - 1, 1)
    return logits.float().cpu().numpy(), tokens, prefill, per_token
