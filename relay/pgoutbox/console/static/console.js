// The console works without this script; it adds "select all" to the selection
// tables and a loading bar while the next page is on its way.
document.addEventListener("change", (event) => {
  const box = event.target;
  const name = box.getAttribute && box.getAttribute("data-select-all");
  if (!name) return;
  for (const other of box.form.querySelectorAll(`input[type=checkbox][name="${name}"]`)) other.checked = box.checked;
});
const busy = () => document.documentElement.classList.add("busy");
document.addEventListener("submit", busy);
document.addEventListener("click", (event) => {
  const link = event.target.closest && event.target.closest("a[href]");
  if (link && !link.target && !event.ctrlKey && !event.metaKey && !event.shiftKey) busy();
});
// Back from the browser's cache: not loading any more.
window.addEventListener("pageshow", () => document.documentElement.classList.remove("busy"));
