---- MODULE Stutter ----
\* No fairness: the behaviour may stutter forever at x = 0.
EXTENDS Naturals
VARIABLES x, y
Init == x = 0 /\ y = "a"
Step == x < 2 /\ x' = x + 1 /\ y' = y
Spec == Init /\ [][Step]_<<x, y>>
Done == <>(x = 2)
====
