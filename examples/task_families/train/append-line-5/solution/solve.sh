#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'kestrel juniper' >> orchid.txt
