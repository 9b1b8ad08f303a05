"""What the step viewer's keys do (keys.py APP_KEYS; a source's own keys too): most become the source's
commands (drivers/base.py Driver), the rest move the view (pin a step, fold a pane, pick a request). A key the
source cannot honour never gets here: the screen dims it and says why (screens/base.py)."""

from __future__ import annotations

from textual import on
from textual.widgets import Input

from ..widgets.step.chat_pane import ChatPane
from ..widgets.step.diagnostics_pane import DiagnosticsPane
from ..widgets.step.layers_pane import LayersPane
from ..widgets.step.program_input import ProgramInput
from ..widgets.step.requests_pane import RequestsPane
from ..widgets.step.token_buffer import TokenBufferPane
from ..widgets.step.topk_pane import TopKPane
from .base import SourceScreen

HISTORY_NOTE = "step {step} is older than the last steps kept in memory (it is in the trace)"


class StepKeys(SourceScreen):
    """The step viewer's key actions: StepScreen's base, kept apart from what it shows (a Screen, so that its
    `@on` handlers are collected)."""

    # ---- chat input ---------------------------------------------------------------------------------

    @on(Input.Submitted, "#message")
    def send_message(self, event: Input.Submitted) -> None:
        text = event.value.strip() or self.driver.next_turn()
        if not text:
            return
        event.input.value = ""
        self.pinned_step = None
        self.driver.command("send", text)
        self.query_one(TokenBufferPane).focus()
        self.show_next_script_turn()

    def action_next_script_turn(self) -> None:
        """Enter outside the input (the cache pane has the focus after a send): the script's next turn; with no
        script, to the input (where a source takes typed text)."""
        text = self.driver.next_turn()
        if text is None:
            if self.unavailable("focus_input") is None:
                self.action_focus_input()
            return
        self.pinned_step = None
        self.driver.command("send", text)
        self.show_next_script_turn()

    def show_next_script_turn(self) -> None:
        """The input's placeholder: the script's next turn, or how to type a message (the source's words)."""
        self.query_one(ChatPane).input.placeholder = self.driver.input_placeholder()

    # ---- the source's commands --------------------------------------------------------------------------

    def action_focus_input(self) -> None:
        self.driver.focus_input()

    def action_step(self) -> None:
        self.driver.command("step")

    def action_run(self) -> None:
        self.driver.command("run")

    def pause_source(self) -> None:
        self.driver.pause()

    def stop_source(self) -> None:
        self.driver.stop()

    def action_stop(self) -> None:
        if isinstance(self.focused, Input):
            self.query_one(TokenBufferPane).focus()
            return
        if self.pinned_step is not None:
            self.action_live()
            return
        self.driver.stop_turn()

    def action_rewind(self) -> None:
        self.driver.command("rewind", 1)

    def action_rewind_to(self) -> None:
        index = self.query_one(TokenBufferPane).selected_index
        if index is None:
            self.notify("select a token in the buffer first (arrows or click)", severity="warning")
            return
        self.driver.command("rewind_to", index)

    def action_force(self) -> None:
        token_id = self.query_one(TopKPane).selected_token_id
        if token_id is None:
            self.notify("select a token in the top-k pane first", severity="warning")
            return
        self.driver.command("force", token_id)

    @on(TopKPane.Force)
    def force_from_pane(self, message: TopKPane.Force) -> None:
        self.driver.command("force", message.token_id)

    def action_verify(self) -> None:
        self.driver.command("verify")

    def action_export_cache(self) -> None:
        self.driver.command("export")

    def action_reset(self) -> None:
        self.driver.command("reset")

    def action_toggle_step_mode(self) -> None:
        self.step_mode = not self.step_mode
        self.notify(
            "step mode: Enter prefills, space steps" if self.step_mode else "run mode: Enter runs the turn", timeout=3
        )

    def action_sampler(self) -> None:
        self.driver.sampler()

    @on(LayersPane.LayerSelected)
    def layer_selected(self, message: LayersPane.LayerSelected) -> None:
        self.query_one(TokenBufferPane).selected_layer = message.index
        if message.initial:  # the table's first row, which no one chose: the attention view stays on all layers
            return
        self.driver.attention(message.index)
        shown = self.query_one(TokenBufferPane).snapshot
        if shown is not None and shown.attention is not None:
            self.attention_view = (message.index, None)
            self._show_attention(shown)

    def action_attention_layer(self, delta: int) -> None:
        """[ / ]: all layers, then each layer with attention, in turn; the source keeps that layer's heads."""
        snapshot = self.query_one(TokenBufferPane).snapshot
        if snapshot is None or snapshot.attention is None:
            self.notify("no attention in these steps: start with --attention", severity="warning")
            return
        choices: list[int | None] = [None, *(i for i, e in enumerate(snapshot.attention) if e is not None)]
        layer = self.attention_view[0]
        at = choices.index(layer) if layer in choices else 0
        layer = choices[(at + delta) % len(choices)]
        self.attention_view = (layer, None)
        if layer is not None:
            self.driver.attention(layer)  # its heads from the next step
            self.query_one(TokenBufferPane).selected_layer = layer
        self._show_attention(snapshot)

    def action_attention_head(self, delta: int) -> None:
        """{ / }: the selected layer's head mean, then each of its heads."""
        snapshot = self.query_one(TokenBufferPane).snapshot
        layer, head = self.attention_view
        detail = snapshot.attention_detail if snapshot is not None else None
        if snapshot is None or detail is None or layer is None:
            self.notify("pick a layer first ([ / ])", severity="warning")
            return
        if detail.layer != layer:
            if getattr(self.driver, "replay", None) is not None:  # a recording: no step will bring them
                why = f"this recording kept the heads of layer {detail.layer} only"
            elif snapshot.turn_done and not self.engine_busy:  # no step comes until the next message
                why = (
                    f"this step kept the heads of layer {detail.layer}; layer {layer}'s are kept from the next "
                    "forward (the turn is over: send a message)"
                )
            else:
                why = f"the heads of layer {layer} arrive with the next step"
            self.notify(why, timeout=5)
            return
        choices: list[int | None] = [None, *range(len(detail.heads))]
        at = choices.index(head) if head in choices else 0
        self.attention_view = (layer, choices[(at + delta) % len(choices)])
        self._show_attention(snapshot)

    def action_watch(self) -> None:
        token = self.query_one(TopKPane).selected_token
        if token is None:
            self.notify("select a token in the top-k pane first", severity="warning")
            return
        self.driver.watch(token)

    def action_restart_engine(self) -> None:
        self.driver.restart()

    def action_save_trace(self) -> None:
        self.driver.save_trace()

    # keys only some sources bind (their BINDINGS): the source does what they say (Driver: not available)
    def action_break_on_alarm(self) -> None:
        self.driver.toggle_break_on_alarm()

    def action_next_row(self) -> None:
        """n: the next request of a packed forward (continuous batching), else the source's next batch row."""
        if self.packed and self.query_one(RequestsPane).select_next() is not None:
            return
        self.driver.next_row()

    def action_next_model(self) -> None:
        self.driver.next_model()

    # a program's stdin (drivers/program.py mounts the input line)
    @on(ProgramInput.Line)
    def send_line(self, message: ProgramInput.Line) -> None:
        self.driver.send_line(message.text)

    @on(ProgramInput.EndInput)
    def end_input(self) -> None:
        self.driver.end_input()

    @on(ProgramInput.Interrupt)
    def interrupt_program(self) -> None:
        self.driver.interrupt()

    @on(ProgramInput.Leave)
    def leave_input(self) -> None:
        self.query_one(TokenBufferPane).focus()

    # ---- the view ---------------------------------------------------------------------------------------

    @on(RequestsPane.RequestSelected)
    def request_selected(self, message: RequestsPane.RequestSelected) -> None:
        """The cache, cursor and top-k panes show the picked request (at the step shown)."""
        step = self.latest if self.pinned_step is None else self.driver.find_step(self.pinned_step)
        self._show(step)

    @on(DiagnosticsPane.JumpTo)
    def jump_to(self, message: DiagnosticsPane.JumpTo) -> None:
        found = self.driver.find_step(message.step)
        if found is None:
            self.notify(HISTORY_NOTE.format(step=message.step), severity="warning")
            return
        self.pinned_step = message.step
        self._show(found)
        self.notify(f"showing step {message.step}: press g (or Esc) to go back to the live step", timeout=5)

    def action_live(self) -> None:
        self.pinned_step = None
        self._show(self.latest)

    def action_toggle_pane(self, name: str) -> None:
        if name in self._hidden_panes():
            self.hidden.discard(name)
            self.shown.add(name)
        else:
            self.hidden.add(name)
            self.shown.discard(name)
        self._apply_layout()
