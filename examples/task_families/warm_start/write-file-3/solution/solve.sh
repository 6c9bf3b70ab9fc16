#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'kestrel pine' > falcon.txt
