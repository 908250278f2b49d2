"""The wizard's Launch tab: run the selected candidate through ``%%dist_train``, rehearse it, price it on SkyPilot.

:class:`LaunchTab` is mixed into :class:`~.wizard.Wizard`; it reads the controls the wizard builds (``nproc``,
``launch_nodes``, ``launch_steps``, ``backend``, ``cluster_flags``, ``run_name``, ``code``) and the current plan, and
writes the tab's outputs (``launch_msg``, ``launch_line``, ``launch_area``, ``price``). The run goes through the
magic itself with exactly the line the tab prints, so that line reproduces it. Rehearse (beside Launch) runs
:func:`~jupyter_dist.launch.rehearse.rehearse` for the same candidate on a background thread and writes
``rehearse_msg``, ``rehearse_log`` and ``rehearse_out``.
"""

from __future__ import annotations

import base64
import html
import json
import threading
from typing import Any

from ..errors import JupyterDistError
from ..launch.base import BACKEND_SPECS, backend_spec
from .wizard_model import train_line

__all__ = ["LaunchTab", "cost_flags"]


def cost_flags(text: str) -> dict[str, Any]:
    """What of the Launch tab's cluster flags the price depends on.

    ``--gpus NAME:N`` (its N), ``--infra`` / ``--cloud``, ``--spot`` and ``--steps``; ``ValueError`` for a value
    that is missing or not a number.
    """
    import shlex

    out: dict[str, Any] = {"gpus_per_node": None, "infra": None, "spot": False, "steps": None}
    words = shlex.split(text)
    i = 0
    while i < len(words):
        flag, eq, value = words[i].partition("=")
        i += 1
        if flag == "--spot":
            out["spot"] = True
            continue
        if flag not in ("--gpus", "--infra", "--cloud", "--steps"):
            continue
        if not eq:
            if i >= len(words):
                raise ValueError(f"{flag} needs a value")
            value, i = words[i], i + 1
        if flag == "--gpus":
            count = value.partition(":")[2] or "1"
            if not count.isdigit():
                raise ValueError(f"--gpus {value!r}: write NAME[:COUNT] per node, e.g. H100:8")
            out["gpus_per_node"] = int(count)
        elif flag == "--steps":
            if not value.isdigit():
                raise ValueError(f"--steps {value!r}: want a whole number of steps")
            out["steps"] = int(value)
        else:
            out["infra"] = value
    return out


class LaunchTab:
    """The Launch tab's behaviour; the widgets and the plan are the :class:`~.wizard.Wizard`'s."""

    plan: Any
    answer: Any
    plan_var: str
    runs_dir: Any
    run: Any
    dashboard: Any
    train_line: str | None
    _shell: Any
    _prices: dict[Any, Any]
    # the widgets (ipywidgets), built by Wizard._build
    backend: Any
    price: Any
    cluster_flags: Any
    nproc: Any
    launch_nodes: Any
    launch_steps: Any
    launch_msg: Any
    launch_line: Any
    launch_out: Any
    launch_area: Any
    run_name: Any
    code: Any
    inputs: Any
    module: Any
    rehearse_button: Any
    save_calibration_button: Any
    rehearse_msg: Any
    rehearse_log: Any
    rehearse_out: Any
    rehearsal: Any
    rehearsal_thread: threading.Thread | None

    @staticmethod
    def _msg(text: str) -> str:
        raise NotImplementedError  # Wizard's

    def _selected(self) -> str | None:
        raise NotImplementedError  # Wizard's

    def _draw_price(self) -> None:
        """The Launch tab's cost on SkyPilot: the nodes the run asks for, per hour, and planned step time x steps.

        From SkyPilot's price list (:mod:`jupyter_dist.launch.cost`), the line the dry run prints.
        """
        from ..launch.cost import price_for, price_line

        if not backend_spec(self.backend.value).priced:
            self.price.value = ""
            return
        p, name = self.plan, self._selected()
        if p is None or name is None:
            self.price.value = self._msg("price: no strategy fits, so there is no run to price")
            return
        try:
            flags = cost_flags(self.cluster_flags.value)
        except ValueError as exc:
            self.price.value = self._msg(f"price: cluster flags: {exc}")
            return
        nproc = flags["gpus_per_node"] or self.nproc.value
        nodes, steps = self.launch_nodes.value, flags["steps"] or self.launch_steps.value
        for what, value in (("processes per node", nproc), ("nodes", nodes), ("steps", steps)):
            if not isinstance(value, int) or value < 1:
                self.price.value = self._msg(f"price: {what} must be >= 1, got {value!r}")
                return
        nodes = nodes if nodes > 1 else p.hardware.nodes  # as %%dist_train --plan: no --nodes runs the plan's
        acc = p.hardware.accelerator
        key = (acc.name, nproc, nodes, flags["infra"], flags["spot"])
        if key not in self._prices:  # reading SkyPilot's price lists takes a moment: once per request
            self._prices[key] = price_for(acc, nproc, nodes, infra=flags["infra"], spot=flags["spot"])
        text = price_line(self._prices[key], step_time_s=p.candidate(name).time.step_time_s, steps=steps)
        text = text.replace("give --steps N for the run's estimate", "set Steps for the run's estimate")
        self.price.value = f"<div><small>{html.escape(text)}</small></div>"

    def launch(self, *, timeout: float | None = None) -> Any:
        """Run the selected candidate with ``%%dist_train --plan`` semantics; returns the Run (``None`` on an error).

        In IPython/Jupyter the run goes through the ``%%dist_train`` magic itself with exactly the line the panel
        prints (plus ``--no-dashboard``: the panels appear under the Launch button), so the printed line reproduces
        it; on a cluster back-end (``Run on``: SLURM, SkyPilot) too. Without IPython, local runs start directly.
        """
        import shlex

        from ..launch.options import RunOptions
        from ..launch.session import start_run
        from ..plan.candidates import resolve_launch

        p = self.plan
        if p is None or (self.answer is not None and self.answer.problems):
            self.launch_msg.value = self._msg("fix the inputs marked above first: there is no valid plan to run")
            return None
        name = self._selected()
        if name is None:
            self.launch_msg.value = self._msg("nothing fits on this hardware, so there is no strategy to run")
            return None
        cand = p.candidate(name)
        nproc, nodes = self.nproc.value, self.launch_nodes.value
        for what, value in (("processes per node", nproc), ("nodes", nodes)):
            if not isinstance(value, int) or value < 1:
                self.launch_msg.value = self._msg(f"{what} must be >= 1, got {value!r}")
                return None
        run_name = self.run_name.value.strip()
        if not run_name.isidentifier():
            self.launch_msg.value = self._msg(f"run name {run_name!r} must be a valid Python variable name")
            return None
        strategy = "auto" if name == p.recommended else cand.name  # the candidate with its degrees
        try:
            resolve_launch(strategy, p, nproc * nodes, nproc_per_node=nproc)  # what cannot run yet, or fit: one line
        except JupyterDistError as exc:
            self.launch_msg.value = self._msg(str(exc))
            return None
        backend = self.backend.value
        spec = backend_spec(backend)
        try:
            flags = shlex.split(self.cluster_flags.value)
        except ValueError as exc:
            self.launch_msg.value = self._msg(f"cluster flags: {exc}")
            return None
        if flags and not spec.cluster:
            clusters = " or ".join(s.label for s in BACKEND_SPECS.values() if s.cluster)
            self.launch_msg.value = self._msg(f"cluster flags need Run on: {clusters}")
            return None
        extra = [] if strategy == "auto" else ["--strategy", strategy]
        if nodes > 1:
            extra += ["--nodes", str(nodes)]
        if spec.cluster:
            extra += ["--backend", backend]
        if spec.priced and "--steps" not in " ".join(flags):  # the dry run of the line prices the same run
            extra += ["--steps", str(self.launch_steps.value)]
        line = train_line(self.plan_var, nproc=nproc, name=run_name, extra=shlex.join(extra + flags))
        shell = self._shell_with_magics()
        ns = getattr(shell, "user_ns", None)
        if ns is not None:
            ns[self.plan_var] = p
        if timeout is not None:
            line += f" --timeout {timeout:g}"
        try:
            if shell is not None:
                from IPython.core.error import UsageError

                with self.launch_out:
                    try:
                        # no panels and no rank output inside the Launch tab (its run is followed by the run's card)
                        run = shell.run_cell_magic("dist_train", line.removeprefix("%%dist_train ")
                                                   + " --no-dashboard --output none", self.code.value)  # fmt: skip
                    except UsageError as exc:
                        raise JupyterDistError(str(exc)) from None
            elif not spec.cluster:
                opts = RunOptions(nproc=nproc, nodes=nodes, strategy=strategy, plan=p, name=run_name,
                                  runs_dir=self.runs_dir, timeout=timeout, output="none")  # fmt: skip
                run = start_run(self.code.value, opts)
            else:
                raise JupyterDistError(f"a {backend} run launches through the %%dist_train magic: use the wizard in "
                                       "IPython or Jupyter")  # fmt: skip
        except JupyterDistError as exc:
            self.launch_msg.value = self._msg(str(exc))
            return None
        self.run = run
        if ns is not None:
            ns[run_name] = run
        notes = list(getattr(run, "notes", []))  # the mesh, and a rehearsal note when the plan was for more GPUs
        where = spec.where
        what = html.escape(run.candidate or cand.name)
        self.launch_msg.value = (f"<div>started <b>{html.escape(run.name)}</b> {where} ({what}, "
                                 f"{nodes} x {nproc} processes) in <code>{html.escape(str(run.dir))}</code>"
                                 + "".join(f"<br><small>{html.escape(n)}</small>" for n in notes) + "</div>")
        shown = line.removesuffix(f" --timeout {timeout:g}") if timeout is not None else line
        data = base64.b64encode(shown.encode()).decode()
        self.launch_line.value = (
            f"<div>The same run in a cell (the plan is bound to <code>{html.escape(self.plan_var)}</code>): "
            f"<code class='jd-wiz-line'>{html.escape(shown)}</code> "
            f"<button onclick=\"navigator.clipboard.writeText(atob('{data}'))\">Copy</button></div>"
        )
        self.train_line = shown
        try:
            dash = run.dashboard(interval=0.5)
        except JupyterDistError as exc:  # no anywidget/plotly: the run goes on, its card says where it is
            self.launch_area.children = ()
            self.launch_msg.value += f"<small>(no live panels: {html.escape(str(exc))})</small>"
        else:
            self.dashboard = dash
            if dash.widget is not None:
                self.launch_area.children = (dash.widget,)
        return run

    # ---- Rehearse ---------------------------------------------------------------------------------------------
    def _rehearse_model(self) -> Any:
        """What :func:`~jupyter_dist.launch.rehearse.rehearse` builds: the wizard's own model where it has one.

        The model object given to the wizard (a class, a factory or ``"pkg.mod:Factory"``) when the model source is
        *Module*, the pasted Hugging Face config when it is *HF config*, else ``None``: the reference model of the
        plan's shape (a preset or dimensions it does not reproduce are refused in one line).
        """
        inp = self.answer.inputs if self.answer is not None else self.inputs
        if inp.source == "module":
            model = self.module
            if model is not None and not isinstance(model, (str, type)) and hasattr(model, "parameters"):
                raise JupyterDistError("the wizard was given a module instance; Rehearse builds the model again "
                                       "from its class or factory: Wizard(model=MyModel)")  # fmt: skip
            return model
        if inp.source == "hf":
            return json.loads(inp.hf_config)
        return None

    def rehearse(self, *, ranks: Any = None, steps: int = 3, device: str = "auto",
                 timeout: float | None = 1800) -> threading.Thread | None:  # fmt: skip
        """Rehearse the selected candidate's ranks on this machine (Rehearse), on a background thread.

        :func:`~jupyter_dist.launch.rehearse.rehearse` with the wizard's plan, its selected candidate (else the
        recommended one), its model (:meth:`_rehearse_model`) and the default ranks: a line per finished rank in
        ``rehearse_log``, the result's table in ``rehearse_out`` and :attr:`rehearsal`. Returns the thread (``None``
        when refused: a one-line message in ``rehearse_msg``, e.g. while another rehearsal runs).
        """
        from ..launch.rehearse import model_source, rehearse

        running = getattr(self, "rehearsal_thread", None)
        if running is not None and running.is_alive():
            self.rehearse_msg.value = self._msg("a rehearsal is running; wait for it to finish")
            return None
        p = self.plan
        if p is None or (self.answer is not None and self.answer.problems):
            self.rehearse_msg.value = self._msg("fix the inputs marked above first: there is no valid plan to rehearse")
            return None
        name = self._selected()
        if name is None:
            self.rehearse_msg.value = self._msg("nothing fits on this hardware, so there is no strategy to rehearse")
            return None
        try:
            model = self._rehearse_model()
            if model is None:  # the reference model's refusal, at once rather than from the thread
                model_source(None, p)
        except (JupyterDistError, ValueError) as exc:
            self.rehearse_msg.value = self._msg(str(exc))
            return None
        self.rehearse_log.value = ""
        self.rehearse_out.outputs = ()
        self.rehearsal = None
        self.save_calibration_button.disabled = True
        lines: list[str] = []
        self.rehearse_msg.value = (f"<div>rehearsing <b>{html.escape(name)}</b> ({p.world_size} ranks) on this "
                                   "machine, one process per rank...</div>")  # fmt: skip

        def progress(rank: Any) -> None:
            lines.append(f"rank {rank.rank}: " + ("rehearsed" if rank.ok else f"could not be rehearsed: {rank.error}"))
            self.rehearse_log.value = "<div><small>" + "<br>".join(html.escape(x) for x in lines) + "</small></div>"

        def work() -> None:
            try:
                result = rehearse(p, name, model=model, ranks=ranks, steps=steps, device=device, timeout=timeout,
                                  on_rank=progress)  # fmt: skip
                self.rehearsal = result
                bundle = result._repr_mimebundle_()
                self.rehearse_out.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)
                self.rehearse_msg.value = (f"<div>rehearsed <b>{html.escape(name)}</b>: "
                                           + ("every rank ran" if result.ok else "a rank could not be rehearsed")
                                           + "</div>")  # fmt: skip
                self.save_calibration_button.disabled = not result.ok
            except JupyterDistError as exc:
                self.rehearse_msg.value = self._msg(str(exc))
            except Exception as exc:  # the panel shows one line, never a traceback
                self.rehearse_msg.value = self._msg(f"rehearsal failed: {type(exc).__name__}: {exc}")
            finally:
                self.rehearse_button.disabled = False

        self.rehearse_button.disabled = True
        thread = threading.Thread(target=work, name="jd-wizard-rehearse", daemon=True)
        self.rehearsal_thread = thread
        thread.start()
        return thread

    def save_rehearsal_calibration(self) -> str | None:
        """Save the last rehearsal's memory as this hardware's calibration (Save calibration).

        As ``%dist_rehearse --save`` does: later plans of this shape take the rehearsed peak for its candidate.
        Returns the file (also shown in ``rehearse_msg``), or ``None`` with the one-line reason (no rehearsal yet,
        one on another device than the plan's).
        """
        result = self.rehearsal
        if result is None:
            self.rehearse_msg.value = self._msg("rehearse first: there is no rehearsal to save")
            return None
        try:
            path = result.save_calibration()
        except JupyterDistError as exc:
            self.rehearse_msg.value = self._msg(str(exc))
            return None
        self.save_calibration_button.disabled = True  # saved; a new rehearsal enables it again
        self.rehearse_msg.value = (f"<div>calibration saved to <code>{html.escape(path)}</code>: plans of this shape "
                                   f"on this hardware take the rehearsed peak of <b>{html.escape(result.candidate)}"
                                   "</b></div>")  # fmt: skip
        return path

    def _shell_with_magics(self) -> Any:
        """The IPython shell with ``%%dist_train`` registered (loading the extension if needed), or ``None``."""
        shell = self._shell
        if shell is None:
            try:
                from IPython import get_ipython

                shell = get_ipython()
            except ImportError:
                return None
        if shell is None or not hasattr(shell, "run_cell_magic"):
            return None
        if "dist_train" not in shell.magics_manager.magics.get("cell", {}):
            shell.run_line_magic("load_ext", "jupyter_dist")
        return shell
