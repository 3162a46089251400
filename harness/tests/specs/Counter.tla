---- MODULE Counter ----
EXTENDS Naturals
VARIABLE x
Init == x = 0
Incr == x' = x + 1
Next == Incr
TypeOK == x \in Nat
Small == x < 3
====
