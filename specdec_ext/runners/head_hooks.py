"""Hooks on a target's LM head, thread by thread.

Heads on the target (drafters/heads_drafter.py) read the LM head's input of the target's last pass through a
forward pre-hook, which sits on the model that every thread's generate() calls share. ``HeadCapture`` keeps
only the passes of the thread its generation runs on right now (``owner``: set while the decode loop is
resumed, ``Drafter.running``; None between resumptions), and ``head_hooked`` says whether a pass on this thread
must call the head's hooks: a capture that is not running here does not count, so a plan and its runner agree
on greedy chains whatever the other generations hook meanwhile (they disagreed, and a plain generation beside
a heads one stopped with "the plan resolved greedy_chain=True"; the heads read each other's passes and failed
with an IndexError). Owned by a thread for good, a capture broke a stream consumed on another thread than
the one that made it, and a plain stream interleaved with a heads stream on one thread.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch


class HeadCapture:
    """A forward pre-hook that keeps the LM head's input of the last pass its owner thread made."""

    def __init__(self):
        self.owner: Optional[int] = None  # the thread running the generation now (None: it is not running)
        self.input: Optional[torch.Tensor] = None  # the head's input of the owner's last pass

    def __call__(self, module, args) -> None:
        if threading.get_ident() == self.owner:
            self.input = args[0]

    def foreign(self) -> bool:
        """Whether it belongs to another thread than the caller's."""
        return threading.get_ident() != self.owner


def foreign_capture(hook) -> bool:
    return isinstance(hook, HeadCapture) and hook.foreign()


def head_hooked(head: torch.nn.Module) -> bool:
    """Whether a pass on this thread must call ``head``'s hooks: any hook but another thread's capture."""
    hooks = list(head._forward_pre_hooks.values()) + list(head._forward_hooks.values())
    return any(not foreign_capture(hook) for hook in hooks)
