#!/bin/bash
# The verifier: writes 1 to /logs/verifier/reward.txt when the check passes, else 0.
cd /app
if python3 -c "
import configparser, sys
c = configparser.ConfigParser(); c.read('config.ini')
s = c['server']
sys.exit(0 if (s['port'], s['host'], s['workers']) == ('9090', '127.0.0.1', '2') else 1)"
then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
