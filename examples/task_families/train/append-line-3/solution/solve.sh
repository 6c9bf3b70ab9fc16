#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'kestrel amber' >> falcon.txt
