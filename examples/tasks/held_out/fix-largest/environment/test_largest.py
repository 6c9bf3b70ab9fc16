from largest import largest

assert largest([3, 9, 2]) == 9
assert largest([-1, -5]) == -1
print('ok')
