"""The floor of exposed exchange time, and the record of a run it is computed from.

- :mod:`.floor`: the least exposure a pair's two halves could reach, from their segments and
  exchanges, by an exact dynamic program (pure: no torch).
- :mod:`.record`: the overlap layer's report of each pair's segments, exchanges and waits while
  a benchmark records, cut into the floor's segments; a step's measured, in-order, floor and
  1F1B exposure.

Imports nothing else of the package, so the overlap layer, the adapter and the tools all reach it.
"""
