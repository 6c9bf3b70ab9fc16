#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'nectar kestrel' > jasper.txt
