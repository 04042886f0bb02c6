"""Operations on runs: `graphtrain plot` (an HTML page comparing runs)."""
