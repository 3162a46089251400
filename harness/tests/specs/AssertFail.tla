---- MODULE AssertFail ----
EXTENDS Naturals, TLC
VARIABLE x
Init == x = 0
Next == /\ Assert(x < 1, "x got too big")
        /\ x' = x + 1
====
