// The console works without this script; it only adds "select all" to the selection tables.
document.addEventListener("change", (event) => {
  const box = event.target;
  const name = box.getAttribute && box.getAttribute("data-select-all");
  if (!name) return;
  for (const other of box.form.querySelectorAll(`input[type=checkbox][name="${name}"]`)) other.checked = box.checked;
});
