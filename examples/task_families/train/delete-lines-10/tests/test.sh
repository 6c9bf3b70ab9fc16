#!/bin/bash
# The verifier: writes 1 to /logs/verifier/reward.txt when the check passes, else 0.
cd /app
if cmp -s orchid.txt /tests/expected
then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
