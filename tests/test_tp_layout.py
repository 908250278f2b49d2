"""The tensor-parallel layout derived from a model's structure (``jd.suggest_tp_plan``).

Unit tests compare the derived layout with the hand-written ones (the reference model's ``tp_plan()``, a Hugging
Face Llama's ``base_model_tp_plan`` translated by ``jd.wrap``) style by style, and check the one-line refusals. The
slow test runs a nanoGPT-style cell under ``%%dist_train --nproc 2 --strategy fsdp2+tp2+sp`` with no layout written
by hand, and compares its losses and final parameters with the same cell run in one plain process (the equal-math
check of tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from jupyter_dist.worker._tp_layout import describe_style, suggest_tp_plan  # noqa: E402

NANOGPT = """
import torch, torch.nn as nn, torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)   # q, k and v fused
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=128, block_size=32, n_embd=64, n_head=4, n_layer=2, tied=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
"""

TRAIN = """
import jupyter_dist.worker as jd

torch.manual_seed(0)
model = GPT()
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
model, opt = jd.wrap(model, opt)                 # no tp_plan: the layout is derived from the model
losses = []
for step in range(5):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = (torch.randint(0, 128, (8, 1), generator=g) + 3 * torch.arange(17)
              + torch.randint(0, 3, (8, 17), generator=g)) % 128
    local = tokens.chunk(jd.dp_size)[jd.dp_rank]
    loss = F.cross_entropy(model(local[:, :-1]).reshape(-1, 128), local[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
params = {k.replace("_fsdp_wrapped_module.", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
          for k, p in model.named_parameters()}
if jd.rank == 0:
    torch.save({"losses": losses, "params": params, "mesh": str(jd.mesh and jd.mesh.describe())}, OUT)
"""


def gpt(**kw: object) -> torch.nn.Module:
    ns: dict[str, object] = {}
    exec(NANOGPT, ns)  # noqa: S102 - the test's own model source, shared with the notebook cell
    return ns["GPT"](**kw)  # type: ignore[operator, no-any-return]


def described(plan: dict) -> dict[str, str]:
    return {k: describe_style(v) for k, v in plan.items()}


# ------------------------------------------------------------------------------------------ equal to hand-written
@pytest.mark.parametrize("sp", [False, True])
def test_derived_layout_of_the_reference_model_equals_its_hand_written_tp_plan(sp: bool) -> None:
    from jupyter_dist.models import Transformer

    model = Transformer(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    layout = suggest_tp_plan(model, 2, sequence_parallel=sp)
    assert layout.ok, layout.reason
    assert described(layout.plan) == described(model.tp_plan(sequence_parallel=sp))


def test_derived_layout_of_a_hugging_face_llama_equals_its_translated_base_model_tp_plan() -> None:
    transformers = pytest.importorskip("transformers")
    from jupyter_dist.worker._tensor import resolve_tp_plan

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    hf, source = resolve_tp_plan(model, None, sequence_parallel=False, tp=2)
    assert "Hugging Face tp plan" in source
    layout = suggest_tp_plan(model, 2)
    assert layout.ok, layout.reason
    assert described(layout.plan) == described(hf)
    assert "model.layers.*.self_attn.q_proj" in layout.plan and "lm_head" in layout.plan


# ---------------------------------------------------------------------------------------------------- nanoGPT
def test_nanogpt_fused_qkv_is_split_per_part_and_its_attention_runs_on_dtensors() -> None:
    layout = suggest_tp_plan(gpt(), 2, sequence_parallel=True)
    assert layout.ok, layout.reason
    rows = {pattern: (style, why) for pattern, style, why in layout.rows()}
    assert rows["blocks.*.attn.qkv"][0].startswith("FusedColwiseParallel(")
    assert "3 projections" in rows["blocks.*.attn.qkv"][1]
    assert rows["blocks.*.attn"][0].startswith("HeadLocalOps()")
    assert rows["blocks.*.attn.proj"][0] == "RowwiseParallel(in=(S(-1)), out=(S(1)))"
    assert rows["blocks.*.mlp.fc"][0] == "ColwiseParallel(in=(R), out=(S(-1)))"
    assert rows["wpe"][0] == "PrepareModuleOutput((R)->(S(0)))"
    assert {"blocks.*.ln_1", "blocks.*.ln_2", "ln_f", "wte", "lm_head"} <= set(rows)
    text = str(layout)
    assert text.splitlines()[0] == "tensor-parallel layout for GPT (tp=2) with sequence parallelism"
    assert "blocks.*.attn.qkv" in text and "why" in text.splitlines()[1]
    assert "<table>" in layout._repr_mimebundle_()["text/html"]


def test_a_tied_head_is_kept_whole_and_the_layout_says_why() -> None:
    layout = suggest_tp_plan(gpt(tied=True), 2, sequence_parallel=True)
    assert layout.ok, layout.reason
    rows = {pattern: style for pattern, style, _ in layout.rows()}
    assert rows["wte"] == "PrepareModuleOutput((R)->(S(1)))"
    assert rows["lm_head"] == "PrepareModuleInput((S(1))->(R))"
    assert any("share one weight" in n for n in layout.notes)


def test_fused_split_keeps_each_ranks_heads_whole() -> None:
    """The fused weight's placement gives rank r the r-th slice of q, of k and of v (not all of q on rank 0)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    w = torch.arange(12.0).reshape(12, 1)  # q rows 0-3, k rows 4-7, v rows 8-11
    shards = _StridedShard(0, split_factor=3)._split_tensor(w, 2, with_padding=False)[0]
    assert shards[0].flatten().tolist() == [0, 1, 4, 5, 8, 9]
    assert shards[1].flatten().tolist() == [2, 3, 6, 7, 10, 11]


# ---------------------------------------------------------------------------------------------------- refusals
def test_heads_tp_does_not_divide_are_refused_in_one_line() -> None:
    layout = suggest_tp_plan(gpt(n_embd=48, n_head=3), 2)
    assert not layout.ok and layout.plan == {}
    want = "GPT: tp=2 does not divide the 3 attention heads of blocks.*.attn; use a tp degree among 1, 3"
    assert layout.reason == want
    assert "\n" not in str(layout)
    with pytest.raises(Exception, match="no layout for GPT: tp=2 does not divide") as err:
        layout.raise_if_unusable()
    assert "\n" not in str(err.value)


def test_unknown_structure_is_refused_in_one_line() -> None:
    class NoBlocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    layout = suggest_tp_plan(NoBlocks())
    assert layout.reason == ("NoBlocks: found no repeated blocks (an nn.ModuleList or nn.ModuleDict of one block "
                             "class) to lay out")  # fmt: skip

    class Unpaired(torch.nn.Module):  # one Linear per block: nothing closes it row-wise
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8)) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for layer in self.layers:
                h = layer(h)
            return h

    reason = suggest_tp_plan(Unpaired(), 2).reason or ""
    assert reason.startswith("Unpaired: could not tell how layers.*.0 is used"), reason


def test_a_packed_qkv_with_grouped_kv_heads_is_refused_with_what_would_work() -> None:
    class GqaAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(64, 64 + 2 * 16)  # 4 q heads and 1 kv head of 16
            self.o = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).split([64, 16, 16], dim=-1)
            return self.o(q)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 64)
            self.layers = torch.nn.ModuleList(GqaAttention() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for layer in self.layers:
                h = h + layer(h)
            return h

    reason = suggest_tp_plan(Net(), 2).reason or ""
    assert "packed projection of unequal parts" in reason and "one Linear per projection" in reason, reason


def test_jd_wrap_refusal_names_the_reason_and_suggest_is_exported() -> None:
    import jupyter_dist.worker as jd

    assert jd.suggest_tp_plan is not None and "suggest_tp_plan" in jd.__all__


# ------------------------------------------------------------------------------------------------ a real run
# -------------------------------------------------------------------------- %dist_plan shows the layout
def test_dist_plan_of_a_module_shows_the_layout_jd_wrap_derives_for_the_recommended_tp(ip) -> None:  # noqa: ANN001
    """``%dist_plan --module nanogpt:GPT`` with tp 2 + sp: the text and HTML show jd.suggest_tp_plan's table (module
    pattern, style, why) for the recommended candidate; it survives to_dict/from_dict; a plan without tp shows none."""
    from jupyter_dist.plan import Hardware, plan
    from jupyter_dist.plan.plan import Plan

    sys.path.insert(0, str(Path(__file__).resolve().parent / "numerics"))
    from nanogpt import GPT

    p = ip.run_line_magic("dist_plan", "--module nanogpt:GPT --gpus-per-node 8 --strategy fsdp2 --tp 2 --sp")
    assert p.recommended == "fsdp2+tp2+sp" and p.tp_layout_for == "fsdp2+tp2+sp"
    want = suggest_tp_plan(GPT(), 2, sequence_parallel=True)
    assert p.tp_layout.rows == tuple(want.rows()) and p.tp_layout.reason is None
    text, page = p.to_text(), p.to_html()
    assert "Tensor-parallel layout for fsdp2+tp2+sp, derived from GPT's structure (jd.suggest_tp_plan" in text
    for pattern, style, why in want.rows():
        assert f"{pattern}  " in text and style in text and why in text
        assert f"<code>{pattern}</code>" in page
    assert "FusedColwiseParallel" in text and "HeadLocalOps() + PrepareModuleInput((S(1))->(R))" in text
    again = Plan.from_dict(p.to_dict())
    assert again == p and again.to_text() == text
    plain = plan(GPT(), Hardware.from_names("h100", gpus_per_node=8), strategy="fsdp2", tp=1)
    assert plain.tp_layout is None and "Tensor-parallel layout" not in plain.to_text()


def test_dist_plan_says_in_one_line_why_no_layout_can_be_derived() -> None:
    """A requested tp for a module the derivation cannot lay out: no recommendation, and the plan's one line says
    why (the derivation's own reason); a model with a layout of its own gets no derived table."""
    from jupyter_dist.models import Transformer
    from jupyter_dist.plan import Hardware, plan

    sys.path.insert(0, str(Path(__file__).resolve().parent / "numerics"))
    from nanogpt import GPT

    class OneLinearMlp(GPT):  # an MLP of one Linear: nothing closes it row-wise
        def __init__(self) -> None:
            super().__init__()
            for block in self.blocks:
                block.mlp = torch.nn.Sequential(torch.nn.Linear(64, 64))

    hw = Hardware.from_names("h100", gpus_per_node=8)
    p = plan(OneLinearMlp(), hw, strategy="fsdp2", tp=2, sp=False)
    assert p.recommended is None and p.tp_layout is not None and p.tp_layout.rows == ()
    (line,) = [x for x in p.to_text().splitlines() if x.startswith("Tensor-parallel layout")]
    assert line == ("Tensor-parallel layout for fsdp2+tp2: none derived (OneLinearMlp: could not tell how "
                    "blocks.*.mlp.0 is used (no row-wise projection after it in the block)); jd.wrap needs "
                    "tp_plan=...")  # fmt: skip
    assert "none derived (OneLinearMlp: could not tell how" in p.to_html()
    own = plan(Transformer(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2), hw, strategy="fsdp2", tp=2)
    assert own.recommended == "fsdp2+tp2+sp" and own.tp_layout is None


# ------------------------------------------------------------------- hand-written attention on DTensors
@pytest.fixture()
def one_rank_mesh() -> object:
    """A real 1-process gloo group in this process (a store in memory) and its 1-rank device mesh, destroyed after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["mask", "inline", "rope"])
def test_hand_written_attention_meeting_plain_tensors_runs_on_dtensors(kind: str, one_rank_mesh: object) -> None:
    """Whole-width attention (nanoGPT's ``split(n_embd)``; the derived layout runs it on DTensors) that meets plain
    tensors -- nanoGPT's causal-mask buffer, a mask made in the forward without a device (derived on the meta device
    too), rotary tables -- runs under the derived layout (with +sp) with one process's loss and gradients: the
    plain tensors are taken as replicated, also where autograd saved them for the backward."""
    import copy

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    sys.path.insert(0, str(Path(__file__).resolve().parent / "numerics"))
    from manual_attention import GPT as ManualGPT

    torch.manual_seed(0)
    ref = ManualGPT(kind)
    layout = suggest_tp_plan(ref, 2, sequence_parallel=True)
    assert layout.reason is None and described(layout.plan)["h.*.attn"].startswith("HeadLocalOps()"), layout
    model = parallelize_module(copy.deepcopy(ref), one_rank_mesh, layout.plan)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (ref, model):
        logits = m(tokens[:, :-1])
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(g, grads[n], rtol=1e-5, atol=1e-7, msg=n)


def test_hand_written_attention_dtensor_cannot_run_is_refused_in_one_line(one_rank_mesh: object) -> None:
    """Whole-width attention using an operation DTensor has no sharding rule for (``F.unfold``'s im2col): its first
    forward under the derived layout raises one line naming the module, the failing operation and the ways out."""
    from torch.distributed.tensor.parallel import parallelize_module

    from jupyter_dist.worker import WorkerError

    sys.path.insert(0, str(Path(__file__).resolve().parent / "numerics"))
    from manual_attention import GPT as ManualGPT

    model = ManualGPT("unfold")
    model(torch.zeros(2, 8, dtype=torch.long))  # runs as it is
    layout = suggest_tp_plan(model, 2)
    assert layout.reason is None
    model = parallelize_module(model, one_rank_mesh, layout.plan)
    with pytest.raises(WorkerError) as err:
        model(torch.zeros(2, 8, dtype=torch.long))
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert msg.startswith("jd.wrap's derived tp layout runs Attention's forward on DTensors (its code uses whole "
                          "widths"), msg  # fmt: skip
    assert "(NotImplementedError: Operator aten.im2col.default does not have a sharding strategy registered" in msg
    assert msg.endswith("view(B, T, -1, head_dim), reshape(B, T, -1)) so it runs on plain local tensors, or pass "
                        "jd.wrap(model, opt, tp_plan=...)"), msg  # fmt: skip


# --------------------------------------------------------------------------- the wizard shows the layout
def _cells(page: str) -> list[tuple[str, str, str]]:
    """The (module, style, why) rows of a layout table's HTML, unescaped."""
    import html
    import re

    rows = re.findall(r"<tr><td><code>(.*?)</code></td><td><code>(.*?)</code></td><td>(.*?)</td></tr>", page, re.S)
    return [(html.unescape(a), html.unescape(b), html.unescape(c)) for a, b, c in rows]


def test_the_wizard_shows_the_derived_layout_of_the_selected_tp_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Wizard(model=<a nanoGPT>)``: a selected candidate with tp > 1 shows the table ``%dist_plan`` prints for it
    (jd.suggest_tp_plan's rows at that tp and sp, on the Plan and Configs tabs and in the saved HTML); a tp-1
    candidate, or a model that is not a measured module, shows none; each (tp, sp) is derived once per module."""
    pytest.importorskip("ipywidgets")
    from jupyter_dist.plan import Hardware, plan
    from jupyter_dist.ui.wizard import Wizard
    from jupyter_dist.worker import _tp_layout

    sys.path.insert(0, str(Path(__file__).resolve().parent / "numerics"))
    from nanogpt import GPT

    derived: list[tuple[int, bool]] = []
    real = _tp_layout.suggest_tp_plan

    def counted(model: torch.nn.Module, tp: int = 2, *, sequence_parallel: bool = False, **kw: object) -> object:
        derived.append((tp, sequence_parallel))
        return real(model, tp, sequence_parallel=sequence_parallel, **kw)

    monkeypatch.setattr(_tp_layout, "suggest_tp_plan", counted)
    w = Wizard(model=GPT(), gpu="h100-80gb", gpus_per_node=8)
    assert w.plan.recommended == "ddp" and w.tp_layout.value == ""  # the recommendation has no tp
    assert w.tp_layout in w.tabs.children[0].children and w.tp_layout in w.tabs.children[2].children

    for name, tp in (("fsdp2+tp2+sp", 2), ("fsdp2+tp4+pp2+sp", 4)):
        w.candidate.value = name
        page = w.tp_layout.value
        assert f"data-candidate='{name}'" in page and "data-layout='derived'" in page
        want = suggest_tp_plan(GPT(), tp, sequence_parallel=True)
        assert _cells(page) == list(want.rows()) and len(want.rows()) == 12
        assert (f"Tensor-parallel layout for {name}, derived from GPT&#x27;s structure (jd.suggest_tp_plan; jd.wrap "
                "uses it when you pass no tp_plan)") in page  # fmt: skip
        assert page in w.static_html()
    # what %dist_plan prints for the same candidate, cell for cell
    shown = plan(GPT(), Hardware.from_names("h100", gpus_per_node=8), strategy="fsdp2", tp=2, sp=True)
    assert shown.tp_layout_for == "fsdp2+tp2+sp"
    w.candidate.value = "fsdp2+tp2+sp"
    assert shown.tp_layout.to_html("fsdp2+tp2+sp") in w.tp_layout.value

    derived.clear()
    for seq in (512, 1024, 512):  # re-planning on each change asks the module's layout again: derived once
        w.set(seq_len=seq)
    w.candidate.value = "fsdp2+tp4+sp"
    w.candidate.value = "fsdp2+tp2+sp"
    assert derived == [], derived
    assert "data-layout='derived'" in w.tp_layout.value

    w.candidate.value = "fsdp2+pp2"
    assert w.tp_layout.value == ""
    w.candidate.value = "fsdp2+tp2+sp"
    w.controls["source"].value = "preset"  # a preset has no module to lay out
    assert w.plan.model.name != "GPT" and w.tp_layout.value == "" and "tp_layout" not in w.static_html()


def test_the_wizard_says_in_one_line_why_a_module_gets_no_layout() -> None:
    """A module the derivation cannot lay out, asked for tp 2: nothing is recommended, and the wizard shows the
    plan's one line (the derivation's own reason) for the requested candidate, as ``%dist_plan`` does."""
    pytest.importorskip("ipywidgets")
    from jupyter_dist.ui.wizard import Wizard

    sys.path.insert(0, str(Path(__file__).resolve().parent / "numerics"))
    from nanogpt import GPT

    class OneLinearMlp(GPT):  # an MLP of one Linear: nothing closes it row-wise
        def __init__(self) -> None:
            super().__init__()
            for block in self.blocks:
                block.mlp = torch.nn.Sequential(torch.nn.Linear(64, 64))

    w = Wizard(model=OneLinearMlp(), gpu="h100-80gb", gpus_per_node=8, strategy="fsdp2", tp=2)
    assert w.plan.recommended is None and w.candidate.value == ""
    page = w.tp_layout.value
    assert "data-candidate='fsdp2+tp2+sp'" in page and "data-layout='none'" in page and _cells(page) == []
    assert ("Tensor-parallel layout for fsdp2+tp2+sp: none derived (OneLinearMlp: could not tell how blocks.*.mlp.0 "
            "is used (no row-wise projection after it in the block)); jd.wrap needs tp_plan=...") in page  # fmt: skip


@pytest.mark.slow
def test_nanogpt_cell_under_fsdp2_tp2_sp_equals_one_process(ip, runs, tmp_path: Path) -> None:  # noqa: ANN001
    """The nanoGPT cell, no layout written, under `%%dist_train --nproc 2 --strategy fsdp2+tp2+sp`: its 5 losses
    and final parameters equal the same cell run in one plain process (SGD with momentum, 1e-5 relative)."""
    from test_tensor_parallel import assert_equal_math
    from test_worker import clean_env, run_bounded

    single = tmp_path / "single.py"
    single.write_text(f"OUT = {str(tmp_path / 'single.pt')!r}\n" + NANOGPT + TRAIN)
    proc = run_bounded([sys.executable, str(single)], clean_env(), 240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ref = torch.load(tmp_path / "single.pt", weights_only=False)

    cell = f"OUT = {str(tmp_path / 'tp.pt')!r}\n" + NANOGPT + TRAIN
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy fsdp2+tp2+sp --name nanogpt_tp --timeout 240", cell)
    assert run.wait(240) == "succeeded", run.logs()
    got = torch.load(tmp_path / "tp.pt", weights_only=False)
    assert got["mesh"] == "dp_shard=1 x tp=2"
    assert_equal_math(ref, got)
    log = (run.dir / "logs" / "rank-0.log").read_text()
    assert log.count("has no tp layout of its own; using the layout derived from GPT's structure") == 1, log[-3000:]


MANUAL_CELL = """
import sys
import torch
import torch.nn.functional as F
import jupyter_dist.worker as jd
sys.path.insert(0, NUMERICS)
from manual_attention import ATTENTIONS, GPT

for kind in ATTENTIONS:
    torch.manual_seed(0)
    model = GPT(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt = jd.wrap(model, opt)
    losses = []
    for step in range(5):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = (torch.randint(0, 64, (4, 1), generator=g) + 3 * torch.arange(13)) % 64
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for k, p in model.named_parameters()}
    if jd.rank == 0:
        torch.save({"losses": losses, "params": params, "mesh": str(jd.mesh and jd.mesh.describe())}, f"{OUT}.{kind}")
"""


@pytest.mark.slow
def test_hand_written_attention_cells_under_fsdp2_tp2_sp_equal_one_process(ip, runs, tmp_path: Path) -> None:  # noqa: ANN001
    """nanoGPT's attention without the flash path (its causal-mask buffer), a mask made in the forward, rotary
    tables: whole-width code on DTensors meeting plain tensors, under ``%%dist_train --nproc 2 --strategy
    fsdp2+tp2+sp`` with no layout written -- 5 losses and every parameter equal one plain process (1e-5)."""
    from test_tensor_parallel import assert_equal_math
    from test_worker import clean_env, run_bounded

    sys.path.insert(0, str(Path(__file__).resolve().parent / "numerics"))
    from manual_attention import ATTENTIONS

    head = f"NUMERICS = {str(Path(__file__).resolve().parent / 'numerics')!r}\n"
    single = tmp_path / "single.py"
    single.write_text(head + f"OUT = {str(tmp_path / 'single.pt')!r}\n" + MANUAL_CELL)
    proc = run_bounded([sys.executable, str(single)], clean_env(), 240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]

    cell = head + f"OUT = {str(tmp_path / 'tp.pt')!r}\n" + MANUAL_CELL
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy fsdp2+tp2+sp --name manual_attn --timeout 240 "
                            "--no-dashboard", cell)  # fmt: skip
    assert run.wait(240) == "succeeded", run.logs()
    for kind in ATTENTIONS:
        got = torch.load(tmp_path / f"tp.pt.{kind}", weights_only=False)
        assert got["mesh"] == "dp_shard=1 x tp=2", kind
        assert_equal_math(torch.load(tmp_path / f"single.pt.{kind}", weights_only=False), got)
    log = (run.dir / "logs" / "rank-0.log").read_text()
    assert log.count("h.*.attn: HeadLocal") == len(ATTENTIONS), log[-3000:]
