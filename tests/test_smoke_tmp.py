def test_smoke(project, cli, tmp_path):
    print(project.lock.read_text())
    r = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    print(r)
    r = cli("apply", "--checkout", tmp_path / "x", "--index-url", project.index.url, cwd=project.root)
    print(r)
    assert r.rc == 0
    r = cli("export", "--checkout", tmp_path / "x", cwd=project.root)
    print(r)
    r = cli("export", "--check", "--checkout", tmp_path / "x", cwd=project.root)
    print(r)
    r = cli("status", "--checkout", tmp_path / "x", cwd=project.root)
    print(r.out)
    assert 0
