---- MODULE Lasso ----
\* x walks 0 -> 1 -> 2 -> 3 -> 1 -> ... ; "eventually x = 9" fails on a lasso
\* that returns to the state x = 1 (0-based trace index 1).
EXTENDS Naturals
VARIABLE x
Init == x = 0
Step == x' = IF x = 3 THEN 1 ELSE x + 1
Spec == Init /\ [][Step]_x /\ WF_x(Step)
Reach9 == <>(x = 9)
====
