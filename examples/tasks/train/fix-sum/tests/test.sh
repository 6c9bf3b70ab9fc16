#!/bin/bash
# The verifier: writes 1 to /logs/verifier/reward.txt when the check passes, else 0.
cd /app
if python3 -B -c "from total import sum_to; assert [sum_to(n) for n in (1, 4, 100, 0)] == [1, 10, 5050, 0]" && python3 -B test_total.py
then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
