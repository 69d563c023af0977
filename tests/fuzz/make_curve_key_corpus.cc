// Seeds for curve_key_fuzz: a valid key file (a fixed pair: the parser checks the form only), its
// lines swapped with comments and CRLF, and files each parser error names. Usage:
// make_curve_key_corpus DIR
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string pub = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7";
  const std::string sec = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6";
  const std::vector<std::string> seeds = {
      "public-key = " + pub + "\nsecret-key = " + sec + "\n",
      "# comment\r\nsecret-key=" + sec + "\r\n\r\npublic-key =\t" + pub + " \r\n",
      "public-key = " + pub + "\n",
      "public-key = " + pub + "\npublic-key = " + pub + "\n",
      "public-key " + pub + "\n",
      "private-key = " + sec + "\n",
      "public-key = " + pub + "x\nsecret-key = " + sec + "\n",
      "public-key = " + pub.substr(0, 39) + "\"\nsecret-key = " + sec + "\n",
      "",
  };
  for (size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream out(std::string(argv[1]) + "/seed-" + std::to_string(i), std::ios::binary);
    out << seeds[i];
    if (!out) return 1;
  }
  return 0;
}
