"""Operations: what makes a TBA run robust and scalable, one layer out from the algorithm (README, "Reading the code")."""
