---- MODULE Values ----
\* Exercises TLC's value printer: records, functions, sets, sequences, model values, strings.
EXTENDS Integers, Sequences, TLC
CONSTANTS m1, m2
VARIABLES r, f, s, q, str, mv, big
Init ==
  /\ r = [a |-> 1, b |-> {m1, m2}]
  /\ f = (m1 :> "x" @@ m2 :> <<1, -2>>)
  /\ s = {[k |-> 1], [k |-> 2]}
  /\ q = <<>>
  /\ str = "q\"uo\\te"
  /\ mv = m1
  /\ big = -(2^30)
Next == UNCHANGED <<r, f, s, q, str, mv, big>>
Never == q /= <<>>
====
