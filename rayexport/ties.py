"""Tied weights: the one place where alias names are found and resolved (BRIEF 1.1 and 1.3).

Every lookup of a parameter by name goes through `resolve_tied_names`, so a tied model whose
checkpoint holds only the embedding never raises `KeyError: 'lm_head.weight'`, and a tied
head is never written twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import torch

from rayexport.errors import ExportError

log = logging.getLogger(__name__)


def find_tie_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Map each alias parameter name to its canonical name, by Parameter identity.

    The first name `named_parameters(remove_duplicate=False)` yields for a Parameter object is
    canonical; later names of the same object are aliases. A model's declared tie map
    (`_tied_weights_keys` as a target->source dict) is checked against identity, never trusted
    blindly.
    """
    try:
        model.tie_weights()
    except Exception as error:  # noqa: BLE001 - remote-code models raise anything here
        log.warning("tie_weights() failed (%s); using the ties the model already has", error)
    canonical_of: dict[int, str] = {}
    aliases: dict[str, str] = {}
    parameters: dict[str, torch.nn.Parameter] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        parameters[name] = parameter
        first = canonical_of.setdefault(id(parameter), name)
        if first != name:
            aliases[name] = first
    for target, source in _declared_ties(model).items():
        if target in aliases or target not in parameters or source not in parameters:
            continue
        if parameters[target] is not parameters[source]:
            log.info("declared tie %s -> %s is not tied in this model; keeping both", target, source)
    return aliases


def _declared_ties(model: torch.nn.Module) -> dict[str, str]:
    declared = getattr(model, "_tied_weights_keys", None)
    return dict(declared) if isinstance(declared, dict) else {}


@dataclass
class TieResolution:
    """Which present name provides each output name, and what happened to each alias."""

    sources: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    promoted: dict[str, str] = field(default_factory=dict)
    to_compare: list[tuple[str, str]] = field(default_factory=list)


def resolve_tied_names(present: Iterable[str], aliases: dict[str, str]) -> TieResolution:
    """Resolve aliases among the names a checkpoint holds.

    Both canonical and alias present: keep the canonical, drop the alias, and ask for their
    values to be compared (training may have untied them). Only the alias present: promote it
    to the canonical name so a tied parameter never loses its only copy.
    """
    present = list(present)
    present_set = set(present)
    resolution = TieResolution()
    for name in present:
        canonical = aliases.get(name)
        if canonical is None:
            resolution.sources[name] = name
        elif canonical in present_set:
            resolution.dropped.append(name)
            resolution.to_compare.append((canonical, name))
        else:
            resolution.sources[canonical] = name
            resolution.promoted[name] = canonical
    return resolution


def check_tied_values(differences: dict[tuple[str, str], float]) -> None:
    """Refuse to drop an alias whose saved values differ from its canonical tensor."""
    for (canonical, alias), difference in sorted(differences.items()):
        if difference != 0.0:
            raise ExportError(
                f"tied tensors '{canonical}' and '{alias}' differ in the checkpoint "
                f"(max abs difference {difference:.3g}); dropping one would change the model"
            )
