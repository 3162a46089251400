"""Drivers execute spec actions on an implementation and observe its state.

Every driver implements `Driver` (base.py): one method per spec action, with the action's
name, plus `enabled()`, `step()` and `observe()`.
"""
