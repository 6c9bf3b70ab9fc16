#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/ember/d' falcon.txt
