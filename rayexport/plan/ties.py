"""Tied weights: the one place where alias names are found and resolved (BRIEF 1.1 and 1.3).

Every lookup of a parameter by name goes through `resolve_tied_names`, so a tied model whose
checkpoint holds only the embedding never raises `KeyError: 'lm_head.weight'`, and a tied
head is never written twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from rayexport.common.errors import ExportError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def find_tie_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Map each alias parameter name to its canonical name, by Parameter identity.

    Names of one Parameter object form a tie group. The canonical name is the tie source the
    model declares (transformers' `all_tied_weights_keys` / `_tied_weights_keys`, target ->
    source) when it is in the group, else the first name `named_parameters` yields. Declared
    ties are trusted on their own only when `tie_weights()` raised and so could not show them.
    """
    declared = _declared_ties(model)
    try:
        model.tie_weights()
        tied_in_memory = True
    except Exception as error:  # noqa: BLE001 - remote-code models raise anything here
        log.warning("tie_weights() failed (%s); using the model's declared ties", error)
        tied_in_memory = False
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    sources = set(declared.values())
    aliases: dict[str, str] = {}
    for names in groups.values():
        canonical = next((name for name in names if name in sources), names[0])
        aliases.update({name: canonical for name in names if name != canonical})
    if not tied_in_memory:
        parameters = {name for names in groups.values() for name in names}
        for target, source in declared.items():
            if target in parameters and source in parameters and target != source and target not in aliases:
                aliases[target] = aliases.get(source, source)
    return aliases


def _declared_ties(model: torch.nn.Module) -> dict[str, str]:
    """The model's own target -> source tie map (transformers 5), expanded to full names."""
    for attribute in ("all_tied_weights_keys", "_tied_weights_keys"):
        declared = getattr(model, attribute, None)
        if isinstance(declared, dict):
            return {target: source for target, source in declared.items() if isinstance(source, str)}
    return {}


@dataclass
class TieResolution:
    """Which present name provides each output name, and what happened to each alias."""

    sources: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    promoted: dict[str, str] = field(default_factory=dict)
    to_compare: list[tuple[str, str]] = field(default_factory=list)


def resolve_tied_names(present: Iterable[str], aliases: dict[str, str]) -> TieResolution:
    """Resolve aliases among the names a checkpoint holds, one tie group at a time.

    The group's provider is its canonical name when present, else its first present alias,
    promoted to the canonical name so a tied parameter never loses its only copy. Every other
    present name of the group is dropped, and its values are compared with the provider's
    (training may have untied them): with three or more names (T5's shared embedding) two
    aliases are compared even when the canonical is absent.
    """
    present = list(present)
    groups: dict[str, list[str]] = {}
    for name in present:
        groups.setdefault(aliases.get(name, name), []).append(name)
    resolution = TieResolution()
    for canonical, names in groups.items():
        provider = canonical if canonical in names else names[0]
        resolution.sources[canonical] = provider
        if provider != canonical:
            resolution.promoted[provider] = canonical
        for name in names:
            if name != provider:
                resolution.dropped.append(name)
                resolution.to_compare.append((provider, name))
    return resolution


def check_tied_values(differences: dict[tuple[str, str], float]) -> None:
    """Refuse to drop an alias whose saved values differ from its canonical tensor."""
    for (canonical, alias), difference in sorted(differences.items()):
        if difference != 0.0:
            raise ExportError(
                f"tied tensors '{canonical}' and '{alias}' differ in the checkpoint "
                f"(max abs difference {difference:.3g}); dropping one would change the model"
            )
