#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/"debug": false/"debug": true/' settings.json
