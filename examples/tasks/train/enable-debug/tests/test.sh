#!/bin/bash
# The verifier: writes 1 to /logs/verifier/reward.txt when the check passes, else 0.
cd /app
if python3 -c "
import json, sys
d = json.load(open('settings.json'))
sys.exit(0 if d == {'name': 'demo', 'debug': True, 'retries': 3} else 1)"
then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
