#!/bin/bash
# The verifier: writes 1 to /logs/verifier/reward.txt when the check passes, else 0.
cd /app
if python3 -B -c "from largest import largest; assert largest([3, 9, 2]) == 9 and largest([-4, -2]) == -2 and largest([7]) == 7" && python3 -B test_largest.py
then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
